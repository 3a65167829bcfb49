"""Parameters left out of the chunks (`exclude_from_chunks`): ordinary tensors.

The paper lets tensors with irregular access (its example: embeddings) stay outside
chunk management. Here they live as plain tensors in the compute dtype on the compute
device, with an fp32 master each, trained by torch's AdamW with the same groups and
schedule as the chunks, so results do not depend on which parameters were excluded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pstar_core.config import EngineConfig
from pstar_core.optim import GroupHyper, StepHyper


class ExcludedParams:
    def __init__(
        self,
        entries: list[tuple[tuple[str, ...], nn.Parameter]],
        dtype: torch.dtype,
        device: torch.device,
        cfg: EngineConfig,
        groups: list[GroupHyper],
        group_by_id: dict[int, int],
    ) -> None:
        self.params = [p for _, p in entries]
        self.by_name = {n: p for names, p in entries for n in names}
        self.dtype, self.device, self.cfg = dtype, device, cfg
        self.groups, self.group_by_id = groups, group_by_id
        self.masters: dict[int, torch.Tensor] = {}
        self.optimizer: torch.optim.AdamW | None = None
        self.numel = sum(p.numel() for p in self.params)
        self.trainable_numel = sum(p.numel() for p in self.params if p.requires_grad)

    def materialize(self) -> bool:
        """Give each parameter fp32 storage for init; True if it already had weights."""
        preloaded = False
        for p in self.params:
            if p.is_meta:
                shape = p.shape
                torch.utils.swap_tensors(
                    p, nn.Parameter(torch.empty(0, device=self.device), p.requires_grad)
                )
                p.data = torch.empty(shape, dtype=torch.float32, device=self.device)
            else:
                p.data = p.data.to(device=self.device, dtype=torch.float32)
                preloaded = True
        return preloaded

    def sync_from_masters(self) -> None:
        """After init: keep fp32 masters of the trainable ones, cast the params down."""
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in self.params:
            if p.requires_grad:
                master = p.data.clone()
                self.masters[id(p)] = master
                by_group.setdefault(self.group_by_id[id(p)], []).append(master)
            p.data = p.data.to(self.dtype)
        if by_group:
            opt = self.cfg.optimizer
            self.optimizer = torch.optim.AdamW(
                [
                    {
                        "params": ts,
                        "lr": self.groups[g].lr,
                        "weight_decay": self.groups[g].weight_decay,
                    }
                    for g, ts in by_group.items()
                ],
                betas=opt.betas,
                eps=opt.eps,
                foreach=False,
            )
            for group, g in zip(self.optimizer.param_groups, by_group, strict=True):
                group["hyper"] = self.groups[g]

    def grad_norm_sq(self) -> float:
        return sum(float(p.grad.double().square().sum()) for p in self.params if p.grad is not None)

    def average_grads(self, zero: Any) -> None:
        """Data parallel: plain tensors are replicated, so their grads are all-reduced."""
        for p in self.params:
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                zero.all_reduce_mean_(p.grad)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self, grad_scale: float, lr_scale: float, hyper: StepHyper | None = None) -> None:
        """torch's AdamW on the fp32 masters, with the chunks' settings for this step
        (`ChunkAdamW.step`: the config's under its schedule, or `hyper`'s)."""
        if self.optimizer is None:
            return
        for p in self.params:
            master = self.masters.get(id(p))
            if master is not None:
                master.grad = None if p.grad is None else p.grad.float() * grad_scale
        opt = hyper or self.cfg.optimizer
        for group in self.optimizer.param_groups:
            group["lr"], group["weight_decay"] = group["hyper"].at(
                self.cfg.optimizer.lr, hyper, lr_scale
            )
            group["betas"], group["eps"] = tuple(opt.betas), opt.eps
        self.optimizer.step()
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None and p.grad is not None:
                    p.data.copy_(master)
        self.zero_grad()

    def value(self, name: str) -> torch.Tensor | None:
        """The excluded parameter `name` (its fp32 master if trainable), or None."""
        p = self.by_name.get(name)
        if p is None:
            return None
        return self.masters.get(id(p), p)

    def load(self, name: str, own: torch.Tensor, value: torch.Tensor) -> None:
        """Copy a state-dict entry into a parameter (master too) or a buffer."""
        with torch.no_grad():
            p = self.by_name.get(name)
            if p is not None and id(p) in self.masters:
                self.masters[id(p)].copy_(value)
                p.data.copy_(self.masters[id(p)])
            else:
                if tuple(own.shape) != tuple(value.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(value.shape)} in the state dict, "
                        f"{tuple(own.shape)} in the model"
                    )
                own.data.copy_(value)

    def model_data_bytes(self) -> int:
        esize = torch.empty((), dtype=self.dtype).element_size()
        return sum(p.numel() * (esize + (12 if p.requires_grad else 0)) for p in self.params)

    def state_dict(self) -> dict[str, Any]:
        return {
            "masters": [self.masters[id(p)] for p in self.params if id(p) in self.masters],
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }

    def load_masters(self, sd: dict[str, Any]) -> None:
        """The weights of a `state_dict`, without its optimizer state."""
        masters = [self.masters[id(p)] for p in self.params if id(p) in self.masters]
        with torch.no_grad():
            for dst, src in zip(masters, sd["masters"], strict=True):
                dst.copy_(src)
            for p in self.params:
                if id(p) in self.masters:
                    p.data.copy_(self.masters[id(p)])

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.load_masters(sd)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
