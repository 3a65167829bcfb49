"""What runs on a training worker: the one worker loop (`loop`) with its objectives, early
stopping and finish estimate; a job's Ray Train worker (`finetune`, launched by `trainer`)
and `pstar train` (`train_local`, `ray_train`); what workers report (`reporting` to the
store, `runlog` to files). Imports neither the control plane nor the HTTP schema.
"""
