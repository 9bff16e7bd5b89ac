"""Character-level language-modelling corpus built from the Python standard library's own source.

No download: the text is the ``.py`` files of the interpreter that runs this code. The builder is a
plain function (:func:`build_corpus`) usable outside Hydra and Lightning; the DataModule serves
fixed-length windows of the memory-mapped token arrays it writes.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lit_speed.data.pipeline import BatchFetch, LoaderOptions, ResumableDataLoader, check_batch_transform
from lit_speed.data.resumable import ResumableOrderHooks, ResumableShuffle
from lit_speed.run_contract import SummaryExtra, TokenLimits

# A fixed vocabulary (tab, newline, printable ASCII) so token ids never depend on corpus content;
# any other character maps to "?" (index of "?").
VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127))
VOCAB_SIZE = len(VOCAB)  # 97
_UNKNOWN = VOCAB.index("?")
_LUT = np.full(0x110000, _UNKNOWN, dtype=np.uint8)
_LUT[[ord(c) for c in VOCAB]] = np.arange(VOCAB_SIZE, dtype=np.uint8)

# Generated tables and test fixtures: codec maps, test data with odd encodings, vendored packages.
DEFAULT_EXCLUDE = ("encodings/", "test/", "tests/", "idlelib/idle_test/", "site-packages/", "lib2to3/tests/",
                   "__pycache__/", "pydoc_data/")


def encode(text: str) -> np.ndarray:
    """Map text to uint8 token ids of :data:`VOCAB` (unknown characters -> ``?``)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _LUT[codes]


def decode(ids: np.ndarray | torch.Tensor | list[int]) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


@dataclass(frozen=True)
class Corpus:
    """Paths of the memory-mapped train/val token arrays and what they were built from."""

    train_path: Path
    val_path: Path
    meta: dict[str, Any]

    def train_tokens(self) -> np.memmap:
        return np.memmap(self.train_path, dtype=np.uint8, mode="r")

    def val_tokens(self) -> np.memmap:
        return np.memmap(self.val_path, dtype=np.uint8, mode="r")

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]


def source_root(root: str | os.PathLike | None = None) -> Path:
    """``root`` as a folder: ``None`` = this interpreter's standard library; a name that is no folder but an
    installed package (``lightning``) = that package's source folder."""
    if root is None:
        return Path(sysconfig.get_paths()["stdlib"])
    path = Path(root).expanduser()
    if not path.exists() and str(root).isidentifier():
        import importlib.util

        spec = importlib.util.find_spec(str(root))
        if spec is not None and spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations)))
    return path


def list_source_files(root: str | os.PathLike | None = None, exclude: tuple[str, ...] = DEFAULT_EXCLUDE) -> list[Path]:
    """The stdlib ``.py`` files in a deterministic order (sorted relative POSIX paths)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    excluded = tuple(e.rstrip("/") for e in exclude)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        # prune excluded folders (site-packages alone can hold gigabytes)
        dirnames[:] = [d for d in dirnames if not (rel_dir + d).endswith(excluded) and d not in excluded]
        files += [rel_dir + f for f in filenames if f.endswith(".py") and not os.path.islink(os.path.join(dirpath, f))]
    return [root / rel for rel in sorted(files)]


def read_texts(files: list[Path], root: Path, max_bytes: int, digest: Any) -> list[tuple[str, str]]:
    """``(relative path, text)`` of the readable, non-empty UTF-8 ``files`` in order, cut at ``max_bytes`` characters
    in all; each name and text is fed to ``digest`` (a hashlib object: the cache key)."""
    texts: list[tuple[str, str]] = []
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        text = text[: max_bytes - total]
        rel = path.relative_to(root).as_posix()
        digest.update(rel.encode())
        digest.update(text.encode("utf-8"))
        texts.append((rel, text))
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def build_corpus(
    cache_dir: str | os.PathLike,
    max_bytes: int = 4_000_000,
    val_every: int = 10,
    root: str | os.PathLike | None = None,
) -> Corpus:
    """Build (or reuse) the stdlib character corpus and return its memory-mapped token files.

    Files are read in sorted order until ``max_bytes`` characters are collected; every
    ``val_every``-th file goes to validation, so validation text is drawn from across the library
    rather than from its (codec-table-heavy) tail. The cache key is a SHA-256 of the file names,
    contents and builder arguments: same machine and arguments -> same hash -> no rebuild.

    Args:
        cache_dir: Folder for ``charlm-<hash>.{train,val}.bin`` and ``.json``.
        max_bytes: Cap on the total characters taken (train + val).
        val_every: Every n-th file goes to validation (10 -> a 90/10 split).
        root: Source folder, or the name of an installed package (its source); default: the standard library.
    """
    if max_bytes < 10_000:
        raise ValueError(f"max_bytes must be >= 10000, got {max_bytes}")
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2 (every n-th file goes to validation), got {val_every}")
    root = source_root(root)
    digest = hashlib.sha256(f"v1|{max_bytes}|{val_every}".encode())
    texts = read_texts(list_source_files(root), root, max_bytes, digest)
    if not texts:
        raise FileNotFoundError(f"no readable .py files under {root}; pass root= a folder of Python sources")
    content_hash = digest.hexdigest()[:16]
    cache_dir = Path(cache_dir)
    stem = cache_dir / f"charlm-{content_hash}"
    corpus = Corpus(Path(f"{stem}.train.bin"), Path(f"{stem}.val.bin"), {})
    meta_path = Path(f"{stem}.json")
    if meta_path.exists() and corpus.train_path.exists() and corpus.val_path.exists():
        return Corpus(corpus.train_path, corpus.val_path, json.loads(meta_path.read_text()))

    train_parts = [encode(t) for i, (_, t) in enumerate(texts) if i % val_every != val_every - 1]
    val_parts = [encode(t) for i, (_, t) in enumerate(texts) if i % val_every == val_every - 1]
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "content_hash": content_hash, "root": str(root), "files": len(texts),
        "train_files": len(train_parts), "val_files": len(val_parts),
        "train_tokens": int(sum(len(p) for p in train_parts)), "val_tokens": int(sum(len(p) for p in val_parts)),
        "vocab_size": VOCAB_SIZE, "max_bytes": max_bytes, "val_every": val_every,
    }
    # write to temporary names and rename, so an interrupted build never leaves a half file behind
    for path, parts in ((corpus.train_path, train_parts), (corpus.val_path, val_parts)):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        np.concatenate(parts).astype(np.uint8).tofile(tmp)
        os.replace(tmp, path)
    tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return Corpus(corpus.train_path, corpus.val_path, meta)


def unigram_cross_entropy(train: np.ndarray, val: np.ndarray, vocab_size: int = VOCAB_SIZE) -> float:
    """Cross-entropy (nats/token) of ``val`` under the add-one-smoothed token frequencies of ``train``.

    The baseline a language model must beat: it knows which tokens are common, nothing about order.
    """
    counts = np.bincount(np.asarray(train), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = np.bincount(np.asarray(val), minlength=len(counts))
    return float(-(val_counts * logp).sum() / val_counts.sum())


class TokenWindows(Dataset):
    """Windows ``tokens[i*stride : i*stride + block_size + 1]`` split into (input, target) int64 tensors."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, block_size: int, stride: int | None = None) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        if len(tokens) < block_size + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than block_size + 1 = {block_size + 1}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        chunk = torch.from_numpy(np.array(self.tokens[start : start + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def get_batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch of windows with one gather (used by :class:`~lit_speed.data.pipeline.BatchFetch`)."""
        starts = np.asarray(indices, dtype=np.int64) * self.stride
        positions = starts[:, None] + np.arange(self.block_size + 1)
        if isinstance(self.tokens, torch.Tensor):
            chunk = self.tokens[torch.from_numpy(positions)].long()
        else:
            chunk = torch.from_numpy(np.asarray(self.tokens[positions], dtype=np.int64))
        return chunk[:, :-1], chunk[:, 1:]


class CharLMDataModule(ResumableOrderHooks, pl.LightningDataModule):
    """Character-level LM data from the stdlib corpus (see :func:`build_corpus`).

    Args:
        cache_dir: Where the memory-mapped token arrays are cached.
        block_size: Characters of context per sample.
        batch_size: Micro-batch size per device.
        max_bytes: Corpus size cap in characters.
        val_every: Every n-th source file goes to validation.
        train_stride: Offset between consecutive training windows (default ``block_size``).
        max_val_windows: Cap on validation windows, so a validation pass stays short.
        num_workers: DataLoader workers, or ``auto`` (one per spare core, at most 8).
        root: Source folder, or an installed package's name (default: this interpreter's standard library).
        pin_memory: Pin host memory; ``auto`` = only when training on CUDA.
        persistent_workers: Keep workers between epochs; ``None`` = whenever ``num_workers > 0``.
        prefetch_factor: Batches each worker loads ahead (needs ``num_workers > 0``).
        preload: Read the token arrays into RAM instead of memory-mapping them (small corpora).
        batch_transform: Function ``batch -> batch`` applied to training batches after transfer to the device.

    Training batches are gathered a whole batch at a time from the token array (one fancy index instead
    of ``batch_size`` slices and a collate), in the same shuffled order as ``shuffle=True``.
    """

    data_name = "charlm"  # what its messages call it ("charlm training order resumed ...")
    batch_kind = "tokens->next-token"  # what model= must take (lit_speed.run_contract.BatchSource)

    def __init__(
        self,
        cache_dir: str,
        block_size: int = 64,
        batch_size: int = 12,
        max_bytes: int = 4_000_000,
        val_every: int = 10,
        train_stride: int | None = None,
        max_val_windows: int = 512,
        num_workers: int | str = 0,
        root: str | None = None,
        pin_memory: bool | str = "auto",
        persistent_workers: bool | None = None,
        prefetch_factor: int | None = None,
        preload: bool = False,
        batch_transform: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("max_val_windows", max_val_windows)):
            if value < 1:
                raise ValueError(f"{type(self).__name__}({name}={value!r}): {name} must be >= 1, got {value}")
        self.loader = LoaderOptions(num_workers, pin_memory, persistent_workers, prefetch_factor)
        self.save_hyperparameters(ignore=["batch_transform"])
        self.batch_transform = check_batch_transform(type(self).__name__, batch_transform)
        self.batch_size = batch_size
        self.block_size = block_size
        self.max_val_windows = max_val_windows
        self.corpus: Corpus | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: torch.utils.data.Subset | None = None
        self.train_order = ResumableShuffle(self.data_name)  # resumes mid-epoch through state_dict

    @override
    def prepare_data(self) -> None:
        build_corpus(self.hparams.cache_dir, self.hparams.max_bytes, self.hparams.val_every, self.hparams.root)

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:
            return
        self.corpus = build_corpus(self.hparams.cache_dir, self.hparams.max_bytes, self.hparams.val_every, self.hparams.root)
        self._set_windows(self.corpus.train_tokens(), self.corpus.val_tokens())

    def _set_windows(self, train_tokens: np.ndarray, val_tokens: np.ndarray) -> None:
        """Training windows of ``train_tokens``, and up to ``max_val_windows`` evenly spaced validation windows."""
        if self.hparams.preload:
            train_tokens, val_tokens = torch.from_numpy(np.array(train_tokens)), torch.from_numpy(np.array(val_tokens))
        for split, tokens in (("training", train_tokens), ("validation", val_tokens)):
            if len(tokens) < self.block_size + 1:  # TokenWindows' own error names neither setting
                raise ValueError(f"{type(self).__name__}(block_size={self.block_size}): the {split} text has "
                                 f"{len(tokens):,} tokens, fewer than block_size + 1 = {self.block_size + 1}. Fix: a "
                                 "smaller data.block_size, or more text (data.root, data.max_bytes)")
        self.train_dataset = TokenWindows(train_tokens, self.block_size, self.hparams.train_stride)
        self._val_windows = TokenWindows(val_tokens, self.block_size)
        self.val_dataset = self._val_subset(self.max_val_windows)

    def _val_subset(self, count: int) -> torch.utils.data.Subset:
        """``count`` windows evenly spaced across the whole validation text, not just its head."""
        val = self._val_windows
        idx = np.linspace(0, len(val) - 1, num=min(len(val), count)).round().astype(int)
        return torch.utils.data.Subset(val, np.unique(idx).tolist())

    def token_limits(self) -> TokenLimits:
        """Ids of the fixed character vocabulary and the window (``lit_speed.run_contract.TokenSource``)."""
        return TokenLimits(VOCAB_SIZE, self.block_size, "", name=f"the fixed {VOCAB_SIZE}-character vocabulary",
                           positions_source=f"block_size={self.block_size}")

    def unigram_baseline(self) -> float:
        """Validation loss (nats/char) of a model that knows only the training text's character frequencies."""
        self.setup()
        return unigram_cross_entropy(self.corpus.train_tokens(), self.corpus.val_tokens())

    def summary_extras(self) -> list[SummaryExtra]:
        """The unigram baseline, for ``summary.json`` (``unigram_baseline``) and the end-of-run table."""
        return [SummaryExtra("unigram_baseline", "unigram baseline val/loss", self.unigram_baseline())]

    def _loader_kwargs(self) -> dict[str, Any]:
        return self.loader.kwargs(preloaded=self.hparams.preload, trainer=self.trainer)

    @override
    def train_dataloader(self) -> DataLoader:
        # the same draw as shuffle=True, drop_last=True, resumable mid-epoch; each batch gathered in one index
        sampler = self.train_order.sampler_for(len(self.train_dataset), self.batch_size, True, self.trainer)
        return ResumableDataLoader(BatchFetch(self.train_dataset), sampler=sampler, batch_size=None,
                                   **self._loader_kwargs())

    @override
    def val_dataloader(self) -> DataLoader:
        kwargs = {**self._loader_kwargs(), "persistent_workers": False}
        return DataLoader(self.val_dataset, batch_size=max(self.batch_size, 64), shuffle=False, **kwargs)

    def describe(self) -> dict[str, Any]:
        self.setup()
        m = self.corpus.meta
        return {
            "data": f"charlm {m['content_hash']}: {m['train_tokens']:,} train / {m['val_tokens']:,} val chars "
                    f"({m['train_files']}/{m['val_files']} files), block {self.block_size}",
            "unigram baseline": f"{self.unigram_baseline():.4f} nats/char",
        }
