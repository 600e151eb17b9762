"""Models by Hugging Face Hub id: ``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, tag or commit
hash), fetched with `huggingface_hub` into its cache (or `download_dir`) and served from there.

What is fetched (`files_to_fetch`): ``model_index.json`` (and the folder's other top-level JSON,
e.g. ``generation_config.json``) and, for each component the index lists, its config and
tokenizer files plus ONE copy of its weights: ``*.safetensors`` of the chosen `variant` (e.g.
``fp16``: ``*.fp16.safetensors``) where the component has them, else its variant-less
safetensors; ``*.bin`` only for a component without any safetensors. Never the other formats a
repository may carry beside them (``.ckpt`` / single-file checkpoints at the top level, ONNX,
Flax ``.msgpack``, OpenVINO, ``non_ema`` weights, other variants), so the SD 1.5 repository
fetches ~2.7 GB instead of ~45 GB.

The library does the rest as it always does: the token is the one it reads itself (``HF_TOKEN``,
or the one ``hf auth login`` stored), its progress bars show the files, ``HF_HUB_OFFLINE=1``
resolves from the cache without a network (as does a failed connection when the revision is
cached), ``HF_HUB_CACHE`` / ``HF_HOME`` move the cache. This module imports huggingface_hub only
when a Hub id is resolved (no torch).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from diffserve.core.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

#: ``ORG/NAME`` with an optional ``@REVISION`` (the Hub's repository naming rules).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
#: Config and tokenizer files a component folder may need (everything but weights).
_CONFIG_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
#: Weight formats, in order of preference.
_WEIGHT_FORMATS = (".safetensors", ".bin")


@dataclass(frozen=True)
class HubId:
    """A parsed Hub id.

    Attributes:
        repo_id: ``ORG/NAME``.
        revision: branch, tag or commit hash; None = the repository's default branch.
    """

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(model: str | os.PathLike | None) -> HubId | None:
    """`model` as a Hub id, or None when it is not one (None, a path that exists, anything not
    of the form ``ORG/NAME[@REVISION]``). An existing local folder always wins."""
    if model is None or not isinstance(model, (str, os.PathLike)):
        return None
    text = os.fspath(model)
    match = _HUB_ID.match(text)
    if match is None or Path(text).expanduser().exists() or text.startswith((".", "~")):
        return None
    return HubId(match["repo"], match["revision"])


def _is_weight(name: str) -> bool:
    return name.endswith(_WEIGHT_FORMATS) or ".safetensors.index" in name or ".bin.index" in name


def _variant_of(name: str) -> str | None:
    """The variant in a weight file name: ``diffusion_pytorch_model.fp16.safetensors``,
    ``model.fp16-00001-of-00002.safetensors``, ``model-00001-of-00002.fp16.safetensors`` and
    ``model.safetensors.index.fp16.json`` -> ``"fp16"``; None for variant-less files."""
    if ".index" in name:  # STEM.safetensors.index[.VARIANT].json
        tail = name.partition(".index")[2]
        tail = tail[: -len(".json")] if tail.endswith(".json") else tail
        return tail.lstrip(".") or None
    for extension in _WEIGHT_FORMATS:
        if name.endswith(extension):
            name = name[: -len(extension)]
    name = re.sub(r"-[0-9]{5}-of-[0-9]{5}", "", name)
    return name.rsplit(".", 1)[1] if "." in name else None


def files_to_fetch(files: list[str], model_index: dict, variant: str | None = None) -> list[str]:
    """The repository files a diffusers folder's pipeline needs (see the module docstring).

    Args:
        files: every file path in the repository (``/``-separated).
        model_index: the parsed ``model_index.json``.
        variant: weights variant to prefer (``"fp16"``, ``"bf16"``...); None = variant-less.

    Returns:
        The paths to fetch, sorted.

    Raises:
        UnsupportedModelError: a component the index lists has no folder, or no weights in a
            format diffserve loads (when the folder holds any weights at all).
    """
    wanted = {f for f in files if "/" not in f and f.endswith(".json")}
    components = [name for name, entry in model_index.items()
                  if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] is not None]
    for name in components:
        inside = [f for f in files if f.startswith(name + "/") and "/" not in f[len(name) + 1:]]
        if not inside:
            raise UnsupportedModelError(f"the repository has no folder {name!r}, which its model_index.json lists")
        wanted.update(f for f in inside if not _is_weight(f)
                      and any(fnmatch.fnmatch(PurePosixPath(f).name, p) for p in _CONFIG_PATTERNS))
        weights = [f for f in inside if _is_weight(f) and "non_ema" not in f]
        if not weights:
            continue  # schedulers, tokenizers, processors: config files only
        chosen: list[str] = []
        for extension in _WEIGHT_FORMATS:
            of_format = [f for f in weights if f.endswith(extension) or f"{extension}.index" in f]
            by_variant = [f for f in of_format if _variant_of(PurePosixPath(f).name) == variant] if variant else []
            plain = [f for f in of_format if _variant_of(PurePosixPath(f).name) is None]
            chosen = by_variant or plain
            if chosen:
                break
        if not chosen:
            raise UnsupportedModelError(
                f"component {name!r} has no {'variant ' + repr(variant) + ' or ' if variant else ''}variant-less "
                f".safetensors or .bin weights (files: {', '.join(sorted(PurePosixPath(f).name for f in weights))})")
        wanted.update(chosen)
    return sorted(wanted)


def download_model(hub_id: HubId, download_dir: str | os.PathLike | None = None, variant: str | None = None) -> Path:
    """Fetch what the pipeline of `hub_id` needs (`files_to_fetch`) and return the local folder
    (a snapshot in the Hub cache, or under `download_dir`).

    Offline (``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached) the cached snapshot of the
    revision is used as it is.

    Args:
        download_dir: the cache folder to use instead of the library's (``HF_HUB_CACHE``).
        variant: weights variant to fetch (see `files_to_fetch`).

    Raises:
        UnsupportedModelError: no such repository or revision (or it is gated and no token gives
            access), no cached copy while offline, or not a diffusers folder.
    """
    import huggingface_hub
    from huggingface_hub import constants, errors

    cache_dir = None if download_dir is None else str(Path(download_dir).expanduser())
    repo, revision = hub_id.repo_id, hub_id.revision
    if constants.HF_HUB_OFFLINE:
        return _cached(hub_id, cache_dir, "HF_HUB_OFFLINE is set", variant)
    try:
        info = huggingface_hub.HfApi().model_info(repo, revision=revision)
        # the revision as given (not info.sha), so the library records the branch / tag in the cache's
        # refs/ and an offline run later finds it by that name
        index_path = huggingface_hub.hf_hub_download(repo, "model_index.json", revision=revision, cache_dir=cache_dir)
        index = json.loads(Path(index_path).read_text())
        files = [s.rfilename for s in info.siblings or []]
        patterns = files_to_fetch(files, index, variant)
        logger.info("fetching %d files of %s (revision %s)", len(patterns), repo, info.sha)
        folder = huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                                   allow_patterns=patterns)
    except errors.GatedRepoError as exc:
        raise UnsupportedModelError(f"{repo} is gated: accept its terms on huggingface.co and set HF_TOKEN (or run "
                                    f"`hf auth login`) with an account that has access ({_first_line(exc)})") from None
    except errors.RepositoryNotFoundError:
        raise UnsupportedModelError(f"no local folder {str(hub_id)!r}, and the Hugging Face Hub has no repository "
                                    f"{repo!r} (or it is private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise UnsupportedModelError(f"{repo} has no revision {revision!r} (a branch, tag or commit hash)") from None
    except errors.EntryNotFoundError:
        raise UnsupportedModelError(f"{repo} is not a diffusers folder (no model_index.json at its top level)") \
            from None
    except (errors.HfHubHTTPError, OSError) as exc:  # no network, proxy, timeouts: the cache, if it has it
        logger.warning("cannot reach the Hugging Face Hub for %s (%s): using the cached copy", hub_id,
                       _first_line(exc))
        return _cached(hub_id, cache_dir, f"the Hub could not be reached: {_first_line(exc)}", variant)
    return Path(folder)


def _cached(hub_id: HubId, cache_dir: str | None, why: str, variant: str | None = None) -> Path:
    """The cached snapshot of `hub_id`'s revision, checked by the library to hold every file
    `files_to_fetch` names (from the cached ``model_index.json`` and tree listing; a cache
    written without a tree listing is taken as it is).

    Raises:
        UnsupportedModelError: it is not in the cache, or only partly.
    """
    import huggingface_hub
    from huggingface_hub import errors

    repo, revision = hub_id.repo_id, hub_id.revision
    where = cache_dir or "the Hugging Face cache"
    try:
        index_path = huggingface_hub.hf_hub_download(repo, "model_index.json", revision=revision,
                                                     cache_dir=cache_dir, local_files_only=True)
        try:
            files = [f.path for f in huggingface_hub.get_cached_repo_tree(repo, revision=revision,
                                                                          cache_dir=cache_dir)]
        except errors.CachedRepoTreeNotFoundError:
            files = None
        patterns = files_to_fetch(files, json.loads(Path(index_path).read_text()), variant) if files else None
        folder = Path(huggingface_hub.snapshot_download(repo, revision=revision, cache_dir=cache_dir,
                                                        local_files_only=True, allow_patterns=patterns))
    except errors.IncompleteSnapshotError as exc:
        raise UnsupportedModelError(f"the copy of {hub_id} in {where} is incomplete and {why}: complete it with "
                                    f"`diffserve download {hub_id}` (with a network) ({_first_line(exc)})") from None
    except (errors.LocalEntryNotFoundError, FileNotFoundError):
        raise UnsupportedModelError(f"{hub_id} is not in {where} and {why}: download it first (`diffserve download "
                                    f"{hub_id}`, with a network)") from None
    return folder


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
