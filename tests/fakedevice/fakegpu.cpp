// fakegpu: a PrivateUse1 backend for CPU-only tests (built by tests/fakedevice/__init__.py).
//
// Tensors live in host memory but carry the device "fakegpu:0", so every rule a GPU
// enforces (same device for all operands, no NumPy view, explicit copies both ways) fails
// here as it would on CUDA, while the arithmetic is exactly torch's CPU kernels.
//
// Pieces:
//   - an allocator that counts live and peak bytes (memory_allocated & co.);
//   - the few kernels a backend must own (empty, copies, views, resize_, set_);
//   - a boxed fallback for every other op: check devices, alias each fakegpu tensor as a
//     CPU tensor sharing its memory, run the CPU kernel, turn CPU results back into
//     fakegpu tensors (views stay views, fresh results are copied);
//   - ops whose CompositeExplicitAutograd kernel would beat the fallback (layer norm, ...)
//     and scaled_dot_product_attention's kernel choice are sent to the CPU kernels too, so
//     a fakegpu run is bitwise a CPU run;
//   - autocast with CUDA's op policy;
//   - device guard, hooks (generator, pinned host memory, storage resize) and an RNG;
//   - FakeNcclBackend: a c10d Backend whose collectives are implemented in Python
//     (tests/fakedevice/fakenccl.py), because c10d::Backend cannot be subclassed there.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace {

constexpr auto kFake = c10::DeviceType::PrivateUse1;
const c10::Device kFakeDevice(kFake, 0);

bool is_fake(const at::Tensor& t) {
  return t.defined() && t.device().type() == kFake;
}

// ---------------------------------------------------------------------------------------
// Allocators
// ---------------------------------------------------------------------------------------

// Device memory: host memory, counted. The size of each live block is kept so a free
// subtracts exactly what its allocation added.
struct FakeAllocator final : c10::Allocator {
  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};

  static void deleter(void* p);

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      {
        std::lock_guard<std::mutex> g(mu);
        sizes[p] = n;
      }
      int64_t now = live.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
      int64_t old = peak.load();
      while (now > old && !peak.compare_exchange_weak(old, now)) {
      }
    }
    return {p, p, &deleter, kFakeDevice};
  }

  void release(void* p) {
    if (!p) return;
    size_t n;
    {
      std::lock_guard<std::mutex> g(mu);
      auto it = sizes.find(p);
      TORCH_INTERNAL_ASSERT(it != sizes.end(), "fakegpu: freeing an unknown pointer");
      n = it->second;
      sizes.erase(it);
    }
    live.fetch_sub(static_cast<int64_t>(n));
    c10::free_cpu(p);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

FakeAllocator g_alloc;
void FakeAllocator::deleter(void* p) {
  g_alloc.release(p);
}
// what c10::GetAllocator(PrivateUse1) returns (torch.UntypedStorage(n, device=...), ...)
REGISTER_ALLOCATOR(kFake, &g_alloc)

// "Pinned" host memory: plain CPU memory whose pointers are remembered, so
// tensor.pin_memory() / is_pinned() behave as with CUDA.
struct PinnedAllocator final : c10::Allocator {
  std::mutex mu;
  std::unordered_set<void*> ptrs;

  static void deleter(void* p);

  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> g(mu);
      ptrs.insert(p);
    }
    return {p, p, &deleter, c10::Device(c10::kCPU)};
  }

  bool contains(const void* p) {
    std::lock_guard<std::mutex> g(mu);
    return ptrs.count(const_cast<void*>(p)) > 0;
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

PinnedAllocator g_pinned;
void PinnedAllocator::deleter(void* p) {
  if (!p) return;
  {
    std::lock_guard<std::mutex> g(g_pinned.mu);
    g_pinned.ptrs.erase(p);
  }
  c10::free_cpu(p);
}

// ---------------------------------------------------------------------------------------
// Random numbers: the device has its own generator state (as CUDA does), kept in a CPU
// generator so torch's CPU kernels can use it.
// ---------------------------------------------------------------------------------------

struct FakeGeneratorImpl final : c10::GeneratorImpl {
  at::Generator inner;  // a CPUGeneratorImpl

  explicit FakeGeneratorImpl(at::Generator cpu = at::detail::createCPUGenerator())
      : c10::GeneratorImpl(kFakeDevice, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        inner(std::move(cpu)) {}

  void set_current_seed(uint64_t seed) override {
    inner.set_current_seed(seed);
  }
  void set_offset(uint64_t offset) override {
    inner.set_offset(offset);
  }
  uint64_t get_offset() const override {
    return inner.get_offset();
  }
  uint64_t current_seed() const override {
    return inner.current_seed();
  }
  uint64_t seed() override {
    return inner.seed();
  }
  void set_state(const c10::TensorImpl& state) override {
    inner.unsafeGetGeneratorImpl()->set_state(state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    return inner.unsafeGetGeneratorImpl()->get_state();
  }

 private:
  FakeGeneratorImpl* clone_impl() const override {
    return new FakeGeneratorImpl(inner.clone());
  }
};

const at::Generator& default_generator() {
  static at::Generator gen = at::make_generator<FakeGeneratorImpl>();
  return gen;
}

FakeGeneratorImpl* fake_gen(const at::Generator& g) {
  return static_cast<FakeGeneratorImpl*>(g.unsafeGetGeneratorImpl());
}

// ---------------------------------------------------------------------------------------
// Hooks and device guard
// ---------------------------------------------------------------------------------------

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  // resize_bytes_cpu allocates with the storage's own allocator (ours) and memcpy's
  at::native::resize_bytes_cpu(storage, nbytes);
}

struct FakeHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex) const override {
    return true;
  }
  c10::DeviceIndex deviceCount() const override {
    return 1;
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    TORCH_CHECK(d == 0, "fakegpu has one device, got index ", static_cast<int>(d));
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return 0;
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override {
    return 0;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override {
    return 0;
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return default_generator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::make_generator<FakeGeneratorImpl>();
  }
  at::Device getDeviceFromPtr(void*) const override {
    return kFakeDevice;
  }
  bool isPinnedPtr(const void* data) const override {
    return g_pinned.contains(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return &g_pinned;
  }
  // untyped_storage().resize_(n) on a fakegpu storage lands here
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    at::RegisterPrivateUse1HooksInterface(new FakeHooks());
  }
} g_register_hooks;

// One device (index 0), one stream, synchronous: events are no-ops.
struct FakeGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kFake;
  }
  c10::Device exchangeDevice(c10::Device) const override {
    return kFakeDevice;
  }
  c10::Device getDevice() const override {
    return kFakeDevice;
  }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "fakegpu has one device, got ", d);
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kFakeDevice);
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return 1;
  }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag)
      const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override {
    return true;
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override {
    return true;
  }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeGuardImpl);

// ---------------------------------------------------------------------------------------
// CPU aliases: a CPU tensor over the very memory of a fakegpu tensor
// ---------------------------------------------------------------------------------------

// One CPU storage per fakegpu storage within one call, so that CPU kernels see arguments
// that share memory as sharing a storage (overlap checks, views) exactly as the originals.
struct AliasMap {
  std::unordered_map<c10::StorageImpl*, c10::Storage> cpu_of;  // fakegpu -> CPU storage
  std::unordered_map<c10::StorageImpl*, c10::Storage> fake_of;  // CPU -> fakegpu storage

  at::Tensor alias(const at::Tensor& t) {
    const c10::Storage& st = t.storage();
    auto it = cpu_of.find(st.unsafeGetStorageImpl());
    if (it == cpu_of.end()) {
      // non-owning, not resizable: the fakegpu tensor keeps the memory alive
      c10::Storage cpu(
          c10::Storage::use_byte_size_t(), st.nbytes(),
          c10::DataPtr(st.mutable_data(), c10::Device(c10::kCPU)), nullptr, false);
      fake_of.emplace(cpu.unsafeGetStorageImpl(), st);
      it = cpu_of.emplace(st.unsafeGetStorageImpl(), std::move(cpu)).first;
    }
    auto out = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
    if (t.is_conj()) out._set_conj(true);
    if (t.is_neg()) out._set_neg(true);
    return out;
  }

  // A CPU result sharing an aliased storage: the same view over the fakegpu storage.
  at::Tensor unalias(const at::Tensor& cpu) {
    auto it = fake_of.find(cpu.storage().unsafeGetStorageImpl());
    if (it == fake_of.end()) return at::Tensor();
    auto out = at::detail::make_tensor<c10::TensorImpl>(
        c10::Storage(it->second), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
        cpu.dtype());
    out.unsafeGetTensorImpl()->set_sizes_and_strides(
        cpu.sizes(), cpu.strides(), cpu.storage_offset());
    if (cpu.is_conj()) out._set_conj(true);
    if (cpu.is_neg()) out._set_neg(true);
    return out;
  }
};

// A fresh fakegpu tensor holding a copy of a CPU tensor (dense layouts keep their strides).
at::Tensor to_fake(const at::Tensor& cpu) {
  at::Tensor out = cpu.is_non_overlapping_and_dense()
      ? at::detail::empty_strided_generic(
            cpu.sizes(), cpu.strides(), &g_alloc,
            c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), cpu.scalar_type())
      : at::detail::empty_generic(
            cpu.sizes(), &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
            cpu.scalar_type(), std::nullopt);
  AliasMap m;
  m.alias(out).copy_(cpu);
  return out;
}

// ---------------------------------------------------------------------------------------
// Kernels a backend must own
// ---------------------------------------------------------------------------------------

at::Tensor fake_empty(
    c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
    std::optional<at::Device>, std::optional<bool>, std::optional<at::MemoryFormat> fmt) {
  return at::detail::empty_generic(
      size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype), fmt);
}

at::Tensor fake_empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
    std::optional<at::Layout>, std::optional<at::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(
      size, stride, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

// dst.copy_(self) where either side is on fakegpu (CPU<->fakegpu, fakegpu<->fakegpu):
// CPU copy_ between aliases handles dtype casts, broadcasting and any strides.
at::Tensor fake_copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  for (const auto* t : {&self, &dst}) {
    TORCH_CHECK(
        t->is_cpu() || is_fake(*t), "fakegpu: copy between ", self.device(), " and ",
        dst.device(), " is not supported");
  }
  AliasMap m;
  at::Tensor src = is_fake(self) ? m.alias(self) : self;
  at::Tensor out = is_fake(dst) ? m.alias(dst) : dst;
  out.copy_(src);
  return dst;
}

const at::Tensor& fake_resize_(
    const at::Tensor& self, c10::IntArrayRef size, std::optional<at::MemoryFormat> fmt) {
  // grows the storage through its allocator (ours) when needed
  at::native::resize_impl_cpu_(self.unsafeGetTensorImpl(), size, std::nullopt);
  if (fmt.has_value()) {
    TORCH_CHECK(*fmt != at::MemoryFormat::Preserve, "unsupported memory format ", *fmt);
    self.unsafeGetTensorImpl()->empty_tensor_restride(*fmt);
  }
  return self;
}

at::Tensor fake_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return fake_copy_from(self, dst, false);
}

at::Tensor& fake_set_storage(
    at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
    c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& fake_set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return fake_set_storage(self, std::move(source), 0, {n}, {});
}

at::Tensor& fake_set_source_tensor(at::Tensor& self, const at::Tensor& src) {
  return fake_set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

at::Tensor& fake_set_empty(at::Tensor& self) {
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, &g_alloc, true);
  return fake_set_storage(self, std::move(st), 0, {0}, {});
}

// `param.data = t` across CPU and fakegpu: allowed between dense CPU and CUDA tensors, so
// allowed here too (torch's own check only knows the built-in dense backends).
bool fake_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](c10::DispatchKeySet ks) {
    return ks.has(c10::DispatchKey::Dense) &&
        ks.has_any(c10::DispatchKeySet(
            {c10::BackendComponent::CPUBit, c10::BackendComponent::PrivateUse1Bit}));
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
      (dense(self.key_set()) && dense(from.key_set()));
}

// scaled_dot_product_attention asks this stub which fused kernel the device has; answer
// as the CPU does, so fakegpu runs the very CPU kernel (bitwise equal to CPU) instead of
// the unfused math path torch takes for an unknown device.
int64_t fake_sdp_choice(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
    std::optional<double> scale, bool enable_gqa) {
  AliasMap m;
  std::optional<at::Tensor> cpu_mask;
  if (mask.has_value() && mask->defined()) cpu_mask = is_fake(*mask) ? m.alias(*mask) : *mask;
  return at::_fused_sdp_choice(
      m.alias(q), m.alias(k), m.alias(v), cpu_mask, dropout_p, is_causal, scale, enable_gqa);
}
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(fake_empty));
  m.impl("empty_strided", TORCH_FN(fake_empty_strided));
  m.impl("_copy_from", TORCH_FN(fake_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(fake_copy_from_and_resize));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(fake_resize_));
  m.impl("set_.source_Storage", TORCH_FN(fake_set_source_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(fake_set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(fake_set_source_tensor));
  m.impl("set_", TORCH_FN(fake_set_empty));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(fake_has_compatible_shallow_copy_type));
}

// ---------------------------------------------------------------------------------------
// Boxed fallback for every other op
// ---------------------------------------------------------------------------------------

// CUDA's rule: all tensors on one device, except 0-dim CPU tensors (scalars) and CPU
// index tensors in `Tensor?[] indices` (index / index_put_ move them to the device).
// Returns whether any argument is a fakegpu tensor.
bool check_same_device(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  const auto& schema = op.schema();
  const char* fake_arg = nullptr;
  const char* cpu_arg = nullptr;
  auto visit = [&](const at::Tensor& t, const std::string& name, bool cpu_ok) {
    if (!t.defined()) return;
    if (is_fake(t)) {
      if (!fake_arg) fake_arg = name.c_str();
    } else if (t.is_cpu() && t.dim() > 0 && !cpu_ok) {
      if (!cpu_arg) cpu_arg = name.c_str();
    }
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& iv = args[i];
    const auto& name = schema.arguments()[i].name();
    if (iv.isTensor()) {
      visit(iv.toTensor(), name, false);
    } else if (iv.isTensorList()) {
      for (const at::Tensor& t : iv.toTensorList()) visit(t, name, false);
    } else if (iv.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : iv.toOptionalTensorList()) {
        if (t.has_value()) visit(*t, name, true);
      }
    }
  }
  TORCH_CHECK(
      !(fake_arg && cpu_arg),
      "Expected all tensors to be on the same device, but found at least two devices, "
      "fakegpu:0 and cpu! (when checking argument for argument ",
      cpu_arg, " in method ", schema.operator_name(), ")");
  return fake_arg != nullptr;
}

// While a random op runs on the CPU, the CPU default generator holds the fakegpu state.
struct RngSwap {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  at::Generator fake = default_generator();
  at::Tensor saved;
  RngSwap() {
    saved = cpu.get_state();
    cpu.set_state(fake.get_state());
  }
  ~RngSwap() {
    fake.set_state(cpu.get_state());
    cpu.set_state(saved);
  }
};

// Replace fakegpu tensors in one argument: in-place/mutable ones are aliases (the CPU
// kernel writes straight into fakegpu memory, through any view); out= ones are CPU copies
// (the kernel may resize them) copied back after the call.
struct OutCopy {
  at::Tensor fake;
  at::Tensor cpu;
};

at::Tensor convert(const at::Tensor& t, bool is_out, AliasMap& m, std::vector<OutCopy>& outs) {
  if (!is_fake(t)) return t;
  if (!is_out) return m.alias(t);
  at::Tensor cpu = m.alias(t).clone(at::MemoryFormat::Preserve);
  outs.push_back({t, cpu});
  return cpu;
}

at::Tensor convert_result(
    const at::Tensor& r, AliasMap& m, const std::vector<OutCopy>& outs,
    const std::unordered_map<c10::TensorImpl*, at::Tensor>& originals) {
  if (!r.defined() || !r.is_cpu()) return r;
  auto it = originals.find(r.unsafeGetTensorImpl());
  if (it != originals.end()) return it->second;  // returned self / out
  for (const auto& o : outs) {
    if (o.cpu.unsafeGetTensorImpl() == r.unsafeGetTensorImpl()) return o.fake;
  }
  at::Tensor view = m.unalias(r);  // a view of an input stays a view
  return view.defined() ? view : to_fake(r);
}

bool is_optional_generator(const c10::Argument& arg) {
  const auto& type = arg.type();
  return type->kind() == c10::TypeKind::OptionalType &&
      type->containedType(0)->kind() == c10::TypeKind::GeneratorType;
}

void fake_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t first = stack->size() - nargs;
  const bool has_fake =
      check_same_device(op, c10::ArrayRef<c10::IValue>(stack->data() + first, nargs));

  AliasMap m;
  std::vector<OutCopy> outs;
  std::unordered_map<c10::TensorImpl*, at::Tensor> originals;  // CPU alias -> fakegpu arg
  bool default_rng = false;
  for (size_t i = 0; i < nargs; ++i) {
    c10::IValue& iv = (*stack)[first + i];
    const bool is_out = schema.arguments()[i].is_out();
    if (iv.isTensor()) {
      const at::Tensor t = iv.toTensor();
      at::Tensor c = convert(t, is_out, m, outs);
      if (is_fake(t) && !is_out) originals.emplace(c.unsafeGetTensorImpl(), t);
      iv = c;
    } else if (iv.isTensorList()) {
      auto list = iv.toTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) list.set(j, convert(list.get(j), is_out, m, outs));
      iv = list;
    } else if (iv.isOptionalTensorList()) {
      auto list = iv.toOptionalTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) {
        std::optional<at::Tensor> t = list.get(j);
        if (t.has_value()) list.set(j, convert(*t, is_out, m, outs));
      }
      iv = list;
    } else if (iv.isDevice() && iv.toDevice().type() == kFake) {
      iv = c10::Device(c10::kCPU);  // factory-style ops: build on the CPU, copy below
    } else if (iv.isGenerator()) {
      const c10::Device gd = iv.toGenerator().device();
      TORCH_CHECK(
          gd.type() == kFake || !has_fake,
          "Expected a 'fakegpu' device type for generator but found '", gd, "'");
      if (gd.type() == kFake) iv = fake_gen(iv.toGenerator())->inner;
    } else if (iv.isNone() && is_optional_generator(schema.arguments()[i])) {
      default_rng = true;  // the kernel will draw from the default generator
    }
  }
  {
    // random ops without a generator argument (native_dropout) use the default one too
    if (op.hasTag(at::Tag::nondeterministic_seeded)) default_rng = true;
    std::optional<RngSwap> swap;
    if (default_rng) swap.emplace();
    op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
  }
  for (auto& o : outs) {
    if (o.fake.sizes() != o.cpu.sizes()) o.fake.resize_(o.cpu.sizes());
    fake_copy_from(o.cpu, o.fake, false);
  }
  const size_t nret = schema.returns().size();
  for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
    c10::IValue& iv = (*stack)[i];
    if (iv.isTensor()) {
      iv = convert_result(iv.toTensor(), m, outs, originals);
    } else if (iv.isTensorList()) {
      auto list = iv.toTensorList().copy();
      for (size_t j = 0; j < list.size(); ++j) {
        list.set(j, convert_result(list.get(j), m, outs, originals));
      }
      iv = list;
    }
  }
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
}

// torch.autocast("fakegpu"): CUDA's policy lists (matmuls/convs in lower precision, the
// numerically sensitive ops in fp32); everything else falls through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  using namespace at;  // the policy macros spell signatures as in namespace at
#define FAKE_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define FAKE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define FAKE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define FAKE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(FAKE_LOWER_PRECISION_FP)
  AT_FORALL_FP32(FAKE_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(FAKE_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(FAKE_PROMOTE)
#undef FAKE_LOWER_PRECISION_FP
#undef FAKE_FP32
#undef FAKE_FP32_SET_OPT_DTYPE
#undef FAKE_PROMOTE
}

// Ops with both a CPU kernel and a CompositeExplicitAutograd one (native_layer_norm,
// native_group_norm, ...): the composite would win over the fallback and compute
// differently from the CPU; route them to the fallback (the CPU kernel) instead, so a
// fakegpu run is bitwise a CPU run. Found at load time, so the list follows the torch
// version; returns the op names.
std::vector<std::string> route_cpu_kernels() {
  static std::unique_ptr<torch::Library> lib;
  static std::vector<std::string> routed;
  if (lib) return routed;
  lib = std::make_unique<torch::Library>(
      torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (!op || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    lib->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&fake_fallback>());
    routed.push_back(full);
  }
  return routed;
}

// The kernels registered above by name; every other op goes through the fallback.
const std::vector<std::string> kKernels = {
    "empty.memory_format",
    "empty_strided",
    "_copy_from",
    "_copy_from_and_resize",
    "view",
    "as_strided",
    "_reshape_alias",
    "resize_",
    "set_.source_Storage",
    "set_.source_Storage_storage_offset",
    "set_.source_Tensor",
    "set_",
    "_has_compatible_shallow_copy_type",
};

// ---------------------------------------------------------------------------------------
// c10d backend: forwards each collective to a Python object (fakenccl.py)
// ---------------------------------------------------------------------------------------

namespace py = pybind11;

std::string op_name(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return "SUM";
    case c10d::ReduceOp::AVG:
      return "AVG";
    case c10d::ReduceOp::PRODUCT:
      return "PRODUCT";
    case c10d::ReduceOp::MIN:
      return "MIN";
    case c10d::ReduceOp::MAX:
      return "MAX";
    default:
      return "UNSUPPORTED";
  }
}

class FakeNcclBackend final : public c10d::Backend {
 public:
  FakeNcclBackend(int rank, int size, py::object impl)
      : c10d::Backend(rank, size), impl_(std::move(impl)) {}

  ~FakeNcclBackend() override {
    if (!Py_IsInitialized()) {
      impl_.release();  // after interpreter shutdown: leak rather than touch Python
      return;
    }
    py::gil_scoped_acquire gil;
    impl_ = py::object();
  }

  const std::string getBackendName() const override {
    return "fakenccl";
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& o) override {
    return call("allreduce", tensors, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& o) override {
    return call("broadcast", tensors, o.rootRank);
  }
  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& o) override {
    return call("reduce", tensors, o.rootRank, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions&) override {
    return call("allgather", outputs, inputs);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions&) override {
    return call("allgather_base", output, input);
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", outputs, inputs, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_base", output, input, op_name(o.reduceOp));
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    return call("barrier");
  }

 private:
  // c10d's Python bindings release the GIL before reaching a backend
  template <typename... Args>
  c10::intrusive_ptr<c10d::Work> call(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    py::object work = impl_.attr(name)(std::forward<Args>(args)...);
    return work.cast<c10::intrusive_ptr<c10d::Work>>();
  }

  py::object impl_;
};

}  // namespace

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &fake_sdp_choice)
}  // namespace at::native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fakegpu: a PrivateUse1 device in host memory, for CPU-only tests";
  m.def("memory_allocated", [] { return g_alloc.live.load(); });
  m.def("max_memory_allocated", [] { return g_alloc.peak.load(); });
  m.def("reset_peak_memory_stats", [] { g_alloc.peak.store(g_alloc.live.load()); });
  m.def("registered_kernels", [] { return kKernels; });
  m.def("routed_to_cpu_kernels", [] { return route_cpu_kernels(); });
  m.def("get_rng_state", [] { return default_generator().get_state(); });
  m.def("set_rng_state", [](const at::Tensor& s) {
    at::Generator g = default_generator();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(s);
  });
  m.def("manual_seed", [](uint64_t seed) {
    at::Generator g = default_generator();
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_current_seed(seed);
  });
  m.def("seed", [] {
    at::Generator g = default_generator();
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.seed();
  });
  m.def("initial_seed", [] { return default_generator().current_seed(); });
  py::class_<FakeNcclBackend, c10d::Backend, c10::intrusive_ptr<FakeNcclBackend>>(
      m, "FakeNcclBackend")
      .def(py::init<int, int, py::object>(), py::arg("rank"), py::arg("size"), py::arg("impl"));
}
