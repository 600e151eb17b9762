"""How work runs on a loaded model: `ModelRunner` (a step adapter, step batching) or
`WholeRequestRunner` (any other pipeline class, whole requests one step at a time)."""

from __future__ import annotations


def build_runner(config, parallel=None):
    """The runner `config` asks for: a step adapter when the folder's pipeline class (or the
    custom class) has one, else the whole-request fallback.

    Args:
        parallel: this worker's `diffserve.parallel.state.ParallelState` (multi-process
            executor); None = a single process.

    Raises:
        UnsupportedModelError: the folder cannot be loaded.
        InvalidRequestError: acceleration or parallelism the model does not support.
    """
    from diffserve.memory.offload import weights_device
    from diffserve.pipelines.base import PipelineAdapter
    from diffserve.pipelines.registry import has_adapter
    from diffserve.models.model_index import read_model_index
    from diffserve.runner.loader import import_class, load_adapter, load_pipeline
    from diffserve.runner.model_runner import ModelRunner
    from diffserve.runner.whole_request import WholeRequestRunner

    import torch

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    load_format = "default" if config.load_format == "custom_pipeline" else config.load_format
    custom = import_class(config.custom_pipeline) if config.custom_pipeline else None
    if custom is not None and issubclass(custom, PipelineAdapter):
        adapter = load_adapter(config.model_path, config.torch_device, config.torch_dtype, load_format,
                               config.context_folding and config.ulysses_degree == 1, adapter_cls=custom,
                               load_device=weights_device(config), variant=config.variant,
                               transformer_file=config.transformer_file)
        return ModelRunner(config, adapter, parallel=parallel)
    if custom is None and has_adapter(read_model_index(config.model_path).get("_class_name", "")):
        return ModelRunner(config, parallel=parallel)
    if config.cfg_parallel_size > 1 or config.ulysses_degree > 1:
        from diffserve.core.errors import InvalidRequestError

        name = "cfg_parallel_size" if config.cfg_parallel_size > 1 else "ulysses_degree"
        raise InvalidRequestError(name, getattr(config, name), "1: the folder's pipeline class has no step "
                                  "adapter (whole-request serving does not split forwards)")
    pipe = load_pipeline(config.model_path, config.torch_device, config.torch_dtype, load_format, custom,
                         variant=config.variant, transformer_file=config.transformer_file)
    return WholeRequestRunner(pipe, config)
