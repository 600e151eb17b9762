"""Scale-out inside one engine: CFG parallelism and Ulysses sequence parallelism over
torch.distributed (gloo on CPU, NCCL on GPUs), run by the multi-process executor
(`diffserve.executor.multiproc`). Replicas across machines are Ray Serve's job
(`diffserve.entrypoints.ray_serve`), never a home-made cluster."""
