"""Load a local diffusers folder (``model_index.json``) into a pipeline adapter.

Each component is loaded by its own library's ``from_pretrained`` from its subfolder
(diffusers models and schedulers, transformers text encoders and tokenizers). With
``load_format="dummy"`` models are built from their configs with seeded random weights and no
weight file is read (tests, and benchmarking large architectures without their weights).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import torch

from diffserve.core.errors import UnsupportedModelError
from diffserve.models.model_index import pipeline_config, read_model_index, with_stated_limits
from diffserve.core.library_warnings import silence_inapplicable_library_warnings
from diffserve.pipelines.base import AdapterOptions, PipelineAdapter
from diffserve.pipelines.registry import adapter_class

logger = logging.getLogger(__name__)
silence_inapplicable_library_warnings()
_LIBRARIES = ("diffusers", "transformers")
#: diffusers pipeline packages that folders name as a component's library for classes of their
#: own (SD 1.x/2.x: ``"safety_checker": ["stable_diffusion", "StableDiffusionSafetyChecker"]``; GLM-Image:
#: ``"vision_language_encoder": ["glm_image", "GlmImageForConditionalGeneration"]``, as diffusers saves it);
#: loaded from ``diffusers.pipelines.<name>`` (the class is a transformers model).
_PIPELINE_PACKAGES = ("stable_diffusion", "glm_image")


def _component_class(library: str, class_name: str, component: str) -> type:
    """The class a ``model_index.json`` entry names.

    Raises:
        UnsupportedModelError: an unsupported library, or no such class in it.
    """
    if library not in _LIBRARIES + _PIPELINE_PACKAGES:
        raise UnsupportedModelError(
            f"component in {component!r} comes from library {library!r}; supported: "
            f"{_LIBRARIES + _PIPELINE_PACKAGES}"
        )
    module = importlib.import_module(library if library in _LIBRARIES else f"diffusers.pipelines.{library}")
    cls = getattr(module, class_name, None)
    if cls is None:
        raise UnsupportedModelError(f"{library} has no class {class_name!r} (component {component!r})")
    return cls


def _load_component(library: str, class_name: str, folder: Path, dtype: torch.dtype,
                    load_format: str, device: torch.device, variant: str | None = None) -> Any:
    cls = _component_class(library, class_name, folder.name)
    if library == "diffusers":
        from diffusers import ModelMixin

        if issubclass(cls, ModelMixin):
            if load_format == "dummy":
                with torch.device(device):  # initialise where it will run (fast on GPU)
                    return cls.from_config(cls.load_config(folder)).to(dtype)
            return cls.from_pretrained(folder, torch_dtype=dtype, variant=_variant(folder, variant))
        return cls.from_pretrained(folder)  # schedulers and other config-only objects
    from transformers import AutoConfig, PreTrainedModel

    if issubclass(cls, PreTrainedModel):
        if load_format == "dummy":
            with torch.device(device):
                return cls(AutoConfig.from_pretrained(folder)).to(dtype)
        return cls.from_pretrained(folder, dtype=dtype, variant=_variant(folder, variant))
    return cls.from_pretrained(folder)  # tokenizers


def _variant(folder: Path, variant: str | None) -> str | None:
    """`variant` when the component folder has weights of that variant, else None (its
    variant-less weights; diffusers' ``from_pretrained`` does the same per component)."""
    if variant is None or not any(folder.glob(f"*.{variant}.*")) and not any(folder.glob(f"*.{variant}-*")):
        return None
    return variant


def load_components(model_dir: Path, dtype: torch.dtype, load_format: str = "default",
                    seed: int = 0, device: torch.device | str = "cpu",
                    only: frozenset[str] | None = None, skip: frozenset[str] = frozenset(),
                    transformer_file: str | None = None, variant: str | None = None) -> tuple[str, dict[str, Any]]:
    """Load every component listed in ``model_index.json`` (or the ones `only` names, less `skip`).

    Args:
        model_dir: local diffusers folder.
        dtype: torch dtype for the models (tokenizers and schedulers have none).
        load_format: ``"default"`` or ``"dummy"`` (random weights, seeded with `seed`,
            initialised directly on `device`).
        only / skip: component names to load / to leave out (a multi-stage model's stages load
            their own components, each in its own process).
        transformer_file: a GGUF single-file denoiser loaded instead of the folder's
            ``transformer`` (or ``unet``) weights, with the folder's config
            (`diffserve.quantization.gguf`).
        variant: weights variant (``"fp16"``...) of the components that have it.

    Returns:
        (pipeline class name, {component name: object or None}).

    Raises:
        UnsupportedModelError: no such folder (or a Hub id), no/unreadable model_index.json, a
            component folder missing, or a component that cannot load (the message names the
            missing file); a `transformer_file` that is not GGUF, or holds another architecture
            or size than the folder's denoiser, or a folder without a denoiser.
    """
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    model_dir = Path(model_dir)
    index = read_model_index(model_dir)
    class_name = index.get("_class_name")
    if not isinstance(class_name, str):
        raise UnsupportedModelError(f"{model_dir}/model_index.json has no _class_name")
    from diffserve.pipelines.registry import has_adapter

    custom_loaders = adapter_class(class_name).component_loaders() if has_adapter(class_name) else {}
    if load_format == "dummy":
        torch.manual_seed(seed)
    components: dict[str, Any] = {}
    gguf_target = _denoiser_name(index) if transformer_file is not None else None
    if transformer_file is not None and gguf_target is None:
        raise UnsupportedModelError(f"{model_dir} has no transformer or unet component to load "
                                    f"{transformer_file} into")
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        if not isinstance(entry, list) or len(entry) != 2:
            continue
        if name in skip or (only is not None and name not in only):
            continue
        library, cls_name = entry
        if library is None or cls_name is None:
            components[name] = None
            continue
        folder = model_dir / name
        if not folder.is_dir():
            raise UnsupportedModelError(f"{model_dir}: component folder {name!r} listed in model_index.json "
                                        "is missing")
        try:
            if name == gguf_target:
                from diffserve.quantization.gguf import load_gguf_transformer

                components[name] = load_gguf_transformer(transformer_file, _component_class(library, cls_name, name),
                                                         folder, dtype, device)
            elif name in custom_loaders:
                components[name] = custom_loaders[name](folder)
            else:
                components[name] = _load_component(library, cls_name, folder, dtype, load_format,
                                                   torch.device(device), variant)
        except UnsupportedModelError:
            raise
        except (OSError, ValueError, KeyError) as exc:  # missing / corrupt weight or config files
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedModelError(f"cannot load component {name!r} from {folder}: {first}") from exc
    return class_name, components


def _denoiser_name(index: dict[str, Any]) -> str | None:
    """The folder's denoiser component (``transformer``, else ``unet``), None without one."""
    for name in ("transformer", "unet"):
        entry = index.get(name)
        if isinstance(entry, list) and len(entry) == 2 and entry[0] is not None:
            return name
    return None


def _eval(components: dict[str, Any]) -> None:
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)


def import_class(target: str) -> type:
    """Import ``"package.module:ClassName"``.

    Raises:
        UnsupportedModelError: malformed target, module not importable, or no such class.
    """
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise UnsupportedModelError(f"custom pipeline {target!r} must be 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnsupportedModelError(f"cannot import custom pipeline module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise UnsupportedModelError(f"module {module_name!r} has no class {class_name!r}")
    return cls


def load_adapter(model_dir: Path, device: torch.device, dtype: torch.dtype,
                 load_format: str = "default", context_folding: bool = True,
                 adapter_cls: type[PipelineAdapter] | None = None,
                 load_device: torch.device | None = None, transformer_file: str | None = None,
                 variant: str | None = None) -> PipelineAdapter:
    """Load a model folder and wrap it in the adapter registered for its pipeline class (or
    `adapter_cls`, a custom adapter).

    Args:
        load_device: where the weights are loaded and the adapter's modules stay (default
            `device`). With offload it is the CPU: the adapter computes on `device` (its
            ``device`` attribute) and `diffserve.memory.offload` moves the modules there.
        transformer_file: a GGUF denoiser (see `load_components`).

    Raises:
        UnsupportedModelError: see `load_components`; no adapter for the class.
    """
    load_device = device if load_device is None else load_device
    cls = adapter_cls or adapter_class(read_model_index(model_dir).get("_class_name", ""))  # fails before loading
    class_name, components = load_components(model_dir, dtype, load_format, device=load_device,
                                             skip=frozenset(cls.ar_stage_components),
                                             transformer_file=transformer_file, variant=variant)
    _eval(components)
    options = AdapterOptions(context_folding=context_folding, model_dir=Path(model_dir))
    adapter = (adapter_cls or adapter_class(class_name)).from_components(components, load_device, dtype, options)
    adapter.device = device
    adapter.spec = with_stated_limits(adapter.spec, model_dir)  # the sizes / frames it was trained for
    logger.info("loaded %s from %s on %s (%s)", class_name, model_dir, device, dtype)
    return adapter


def load_ar_stage(model_dir: Path, device: torch.device, dtype: torch.dtype, load_format: str = "default",
                  variant: str | None = None) -> Any:
    """Load a multi-stage folder's AR stage: its `PipelineAdapter.ar_stage_components` only, built
    into the family's `diffserve.pipelines.ar_stage.ARStageModel` (`variant`: see `load_components`).

    Raises:
        UnsupportedModelError: see `load_components`; the family has no AR stage.
    """
    class_name = read_model_index(model_dir).get("_class_name", "")
    cls = adapter_class(class_name)
    if not cls.ar_stage_components:
        raise UnsupportedModelError(f"{class_name} has no AR stage")
    _, components = load_components(model_dir, dtype, load_format, device=device,
                                    only=frozenset(cls.ar_stage_components), variant=variant)
    _eval(components)
    stage = cls.build_ar_stage(components, device, dtype)
    logger.info("loaded the AR stage of %s from %s on %s (%s)", class_name, model_dir, device, dtype)
    return stage


def load_pipeline(model_dir: Path, device: torch.device, dtype: torch.dtype, load_format: str = "default",
                  pipeline_cls: type | None = None, transformer_file: str | None = None,
                  variant: str | None = None) -> Any:
    """Load a model folder into a pipeline object of its own diffusers class (or
    `pipeline_cls`) for whole-request serving (`transformer_file`: see `load_components`).

    Raises:
        UnsupportedModelError: see `load_components`; diffusers has no such pipeline class, or
            the class cannot be built from the folder's components.
    """
    class_name, components = load_components(model_dir, dtype, load_format, device=device,
                                              transformer_file=transformer_file, variant=variant)
    _eval(components)
    if pipeline_cls is None:
        import diffusers

        pipeline_cls = getattr(diffusers, class_name, None)
        if pipeline_cls is None:
            from diffserve.pipelines.registry import supported_pipelines

            raise UnsupportedModelError(
                f"unsupported pipeline class {class_name!r}: diffusers {diffusers.__version__} has no such class "
                "(pass --custom-pipeline module:Class); step adapters exist for: " + ", ".join(supported_pipelines()))
    import inspect

    accepted = inspect.signature(pipeline_cls.__init__).parameters
    settings = {k: v for k, v in pipeline_config(model_dir).items() if k in accepted}
    try:
        pipe = pipeline_cls(**components, **settings)
    except TypeError as exc:
        raise UnsupportedModelError(f"cannot build {pipeline_cls.__name__} from {model_dir}: {exc}") from exc
    if hasattr(pipe, "to"):
        pipe.to(device)
    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    logger.info("loaded %s from %s on %s (%s) for whole-request serving", class_name, model_dir, device, dtype)
    return pipe
