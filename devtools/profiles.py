"""The engine's profile lookup called the way tests and benchmarks want it: on a checkpoint
path (resolved here), with the stores, text and layer patterns as keywords.

    obtain(source, config, stores=..., embeddings=...)   higgs_engine.dynamic.obtain_profile
    get_profile(source, config, cache_dir=..., out=...)    the Profile `higgs profile` gets
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from higgs_engine.dynamic import ProfileResult, ProfileSource, obtain_profile
from higgs_engine.planning.profile import (
    DEFAULT_PROFILE,
    Profile,
    ProfileConfig,
    ProfileDirectory,
    ProfileFile,
    ProfileStore,
)
from higgs_engine.progress import ProgressCallback
from higgs_engine.sources import resolve_model


def obtain(
    source: str | Path,
    config: ProfileConfig | None = None,
    *,
    text: str | None = None,
    stores: Any = (),
    skip: tuple[str, ...] = (),
    embeddings: bool = False,
    selfgen_cache: Path | None = None,
    device: str | None = None,
    compute: bool = True,
    progress: ProgressCallback | None = None,
) -> ProfileResult:
    """higgs_engine.dynamic.obtain_profile of `source` (resolved here) for `config` (None: the
    default) on `text`, found in or saved to `stores`: the linear layers less `skip`, with
    `embeddings` the token embedding and an untied head too."""
    model = resolve_model(source)
    how = ProfileSource(
        config=DEFAULT_PROFILE if config is None else config,
        text=text,
        stores=tuple(stores),
        selfgen_cache=selfgen_cache,
    )
    layers = model.layer_names(skip, embeddings=embeddings)
    return obtain_profile(model, how, layers, progress, device, compute)


def get_profile(
    source: str | Path,
    config: ProfileConfig | None = None,
    *,
    text: str | None = None,
    cache_dir: Path | None = None,
    out: Path | None = None,
    skip: tuple[str, ...] = (),
    compute: bool = True,
    progress: ProgressCallback | None = None,
) -> Profile:
    """The Profile `higgs profile` gets: `obtain` with the file at `out` and the cache
    directory (which also keeps the self-generated text) as its stores."""
    stores: list[ProfileStore] = []
    if out is not None:
        stores.append(ProfileFile(Path(out)))
    if cache_dir is not None:
        stores.append(ProfileDirectory(Path(cache_dir)))
    return obtain(
        source,
        config,
        text=text,
        stores=stores,
        skip=skip,
        selfgen_cache=cache_dir,
        compute=compute,
        progress=progress,
    ).profile
