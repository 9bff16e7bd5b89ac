"""Any folder of text files, tokenized once by a Hugging Face tokenizer (the model's own) and cached.

``python scripts/train.py model=hf_causal_lm data=text_folder model.pretrained=<folder> data.root=<texts>``

:func:`build_token_corpus` is the plain-function core: files in sorted order, every ``val_every``-th to
validation, each followed by the tokenizer's end-of-sequence token, written as memory-mapped ``uint16``/``uint32``
arrays keyed by a SHA-256 of the file names, contents, the tokenizer's vocabulary and the arguments. The
DataModule is :class:`~lit_speed.data.charlm.CharLMDataModule` with this corpus: the same resumable shuffled
windows, batched gathers and fixed validation windows.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from lit_speed.data.charlm import CharLMDataModule, Corpus, TokenWindows, read_texts, source_root, unigram_cross_entropy
from lit_speed.run_contract import TokenLimits

DEFAULT_PATTERNS = ("**/*.txt", "**/*.md", "**/*.rst", "**/*.py")


def load_tokenizer(source: str) -> Any:
    """``AutoTokenizer.from_pretrained(source)`` (a folder or a hub id), with a one-line error naming the setting."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"TextFolderDataModule(tokenizer={source}): needs the transformers package. Fix: pip "
                         "install -e \".[finetune]\" (or bash scripts/run.sh setup)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(f"TextFolderDataModule(tokenizer={source}): no tokenizer there "
                         f"({' '.join(str(error).split())[:200]}). Fix: data.tokenizer=<a folder with tokenizer files, "
                         "e.g. the model's save_pretrained folder> or a hub id (needs network access)") from None
    check_tokenizer_usable(tokenizer, source)
    return tokenizer


# files a tokenizer is saved as (fast tokenizer, sentencepiece, BPE vocab + merges, WordPiece, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")
PROBE_TEXT = "The quick brown fox jumps over the lazy dog."


def check_tokenizer_usable(tokenizer: Any, source: str) -> None:
    """Refuse a tokenizer that encodes ordinary text to nothing (or to unknown tokens only).

    ``transformers`` 5 builds an empty tokenizer from a model folder without tokenizer files (its config names the
    class, the vocabulary is missing) instead of raising; the corpus would be a handful of end-of-text tokens.

    Raises:
        ValueError: Naming the folder, what it holds and the fix (``data.tokenizer``).
    """
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    unknown = getattr(tokenizer, "unk_token_id", None)
    if ids and any(i != unknown for i in ids):
        return
    folder = Path(str(source)).expanduser()
    held = ""
    if folder.is_dir():
        files = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        held = (f"; the folder has {', '.join(files)}" if files else
                f"; the folder has no tokenizer file ({', '.join(TOKENIZER_FILES[:4])}, ...)")
    encoded = "no ids" if not ids else "unknown tokens only"
    raise ValueError(f"TextFolderDataModule(tokenizer={source}): no usable tokenizer there: transformers built "
                     f"{type(tokenizer).__name__} with {len(tokenizer)} token(s), and {PROBE_TEXT[:19]!r}... encodes "
                     f"to {encoded}{held}. Fix: data.tokenizer=<a folder with the model's tokenizer files, or its hub "
                     "id> (data.tokenizer defaults to model.pretrained)")


def list_text_files(root: str | os.PathLike, patterns: Sequence[str] = DEFAULT_PATTERNS) -> list[Path]:
    """Files under ``root`` matching ``patterns``, sorted by relative path (links and hidden folders skipped).
    A name that is no folder but an installed package (``lightning``) means that package's source folder."""
    root = source_root(root)
    if not root.is_dir():
        raise FileNotFoundError(f"TextFolderDataModule(root={root}): no such folder. Fix: data.root=<a folder of "
                                "text files>")
    found = {p for pattern in patterns for p in root.glob(pattern) if p.is_file() and not p.is_symlink()
             and not any(part.startswith(".") for part in p.relative_to(root).parts)}
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what decides the token ids: the vocabulary (and merges) and the end-of-sequence id."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{text}|{getattr(tokenizer, 'eos_token_id', None)}".encode()).hexdigest()[:16]


def build_token_corpus(cache_dir: str | os.PathLike, tokenizer: Any, root: str | os.PathLike,
                       max_bytes: int = 4_000_000, val_every: int = 10,
                       patterns: Sequence[str] = DEFAULT_PATTERNS) -> Corpus:
    """Tokenize the text files under ``root`` once; later calls with the same files and tokenizer reuse the cache.

    Raises:
        FileNotFoundError: ``root`` is not a folder or holds no readable file matching ``patterns``.
        ValueError: ``val_every < 2``, or too little text for a validation file.
    """
    if val_every < 2:
        raise ValueError(f"TextFolderDataModule(val_every={val_every}): must be >= 2 (every n-th file goes to "
                         "validation). Fix: data.val_every=10")
    root = source_root(root)  # a folder, or an installed package's name (lightning)
    digest = hashlib.sha256(f"v1|{max_bytes}|{val_every}|{tokenizer_fingerprint(tokenizer)}".encode())
    texts = [text for _, text in read_texts(list_text_files(root, patterns), root, max_bytes, digest)]
    if len(texts) < 2:
        raise FileNotFoundError(f"TextFolderDataModule(root={root}): {len(texts)} readable text file(s) matching "
                                f"{list(patterns)}; at least 2 are needed (one goes to validation). Fix: data.root=<a "
                                "folder of text files> or data.patterns=[...]")
    stem = Path(cache_dir) / f"text-{digest.hexdigest()[:16]}"
    paths = Corpus(Path(f"{stem}.train.bin"), Path(f"{stem}.val.bin"), {})
    meta_path = Path(f"{stem}.json")
    if meta_path.exists() and paths.train_path.exists() and paths.val_path.exists():
        return Corpus(paths.train_path, paths.val_path, json.loads(meta_path.read_text()))

    eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] + eos for t in texts]
    vocab = len(tokenizer)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    split = {"train": [x for i, x in enumerate(ids) if i % val_every != val_every - 1],
             "val": [x for i, x in enumerate(ids) if i % val_every == val_every - 1] or ids[-1:]}
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    meta = {"content_hash": stem.name[5:], "root": str(root), "files": len(texts), "vocab_size": vocab,
            "train_files": len(split["train"]), "val_files": len(split["val"]), "dtype": np.dtype(dtype).name,
            "train_tokens": sum(map(len, split["train"])), "val_tokens": sum(map(len, split["val"])),
            "tokenizer": str(getattr(tokenizer, "name_or_path", "")), "max_bytes": max_bytes, "val_every": val_every}
    for path, parts in ((paths.train_path, split["train"]), (paths.val_path, split["val"])):
        tmp = path.with_suffix(f".tmp{os.getpid()}")  # renamed into place: never a half-written cache
        np.concatenate([np.asarray(p, dtype=dtype) for p in parts]).tofile(tmp)
        os.replace(tmp, path)
    tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, meta_path)
    return Corpus(paths.train_path, paths.val_path, meta)


#: ``max_val_windows="auto"``: one validation pass reads about this share of the tokens the run trains on (its forward
#: costs ~2% of the training time), at least one window per process...
VAL_TOKEN_FRACTION = 0.05
#: ... and at most this many windows (a fine-tune needs no more).
AUTO_VAL_MAX_WINDOWS = 256


def planned_training_tokens(trainer: Any, batch_size: int, block_size: int, train_windows: int) -> int | None:
    """Tokens the run will train on, from the Trainer's stopping settings (``None`` when only time stops it)."""
    per_batch = batch_size * block_size * max(int(getattr(trainer, "world_size", 1) or 1), 1)
    if getattr(trainer, "max_steps", -1) and trainer.max_steps > 0:
        return trainer.max_steps * max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1) * per_batch
    epochs = getattr(trainer, "max_epochs", None)
    if epochs is not None and epochs > 0:
        return epochs * (train_windows // max(batch_size, 1)) * per_batch
    return None


def auto_val_windows(planned_tokens: int | None, block_size: int, processes: int = 1) -> int:
    """Validation windows for ``max_val_windows="auto"``: :data:`VAL_TOKEN_FRACTION` of the planned training
    tokens, at least one window on every process and at most :data:`AUTO_VAL_MAX_WINDOWS` (the most when the plan
    is unknown).

    At real size a forward pass is seconds per window: 256 windows of 256 tokens validate for minutes, longer than a
    short fine-tune trains; a long run still gets the full set. The floor is one window, not one batch: a 3-step run
    of 4 x 256 tokens on the 0.5B-dims folder validated one batch of 4 windows in 3.4-4.7 s beside 26-32 s of training
    (Z4, 2026-12-02), a third of the tokens it trained on; 5% of them is under one window, and a run that short is a
    look at the pipeline, not a measurement.
    """
    high = max(AUTO_VAL_MAX_WINDOWS, processes)
    if planned_tokens is None:
        return high
    return int(min(max(-(-planned_tokens * VAL_TOKEN_FRACTION // block_size), processes, 1), high))


class TextFolderDataModule(CharLMDataModule):
    """Language-model windows of a folder of text files, tokenized by ``tokenizer`` (tokenized once, cached).

    Args:
        root: Folder of text files.
        tokenizer: A Hugging Face tokenizer folder or hub id (``${model.pretrained}``: the model's own), or a
            tokenizer object.
        cache_dir: Where the token arrays are cached.
        patterns: Glob patterns of the files to read, relative to ``root``.
        max_val_windows: Validation windows, or ``"auto"``: :data:`VAL_TOKEN_FRACTION` of the tokens the run
            trains on (from ``max_steps`` or ``max_epochs``), one window per process to 256 (:func:`auto_val_windows`).
            Validation batches are ``batch_size`` windows, the micro-batch that fits in training.
        block_size, batch_size, max_bytes, val_every, train_stride, num_workers, pin_memory,
        persistent_workers, prefetch_factor, preload, batch_transform: As in
            :class:`~lit_speed.data.charlm.CharLMDataModule`.

    Example::

        dm = TextFolderDataModule("my_texts/", tokenizer="path/to/hf_model", cache_dir=".cache/text")
    """

    data_name = "text_folder"  # what its messages call it ("text_folder training order resumed ...")
    batch_kind = "tokenizer-ids->next-token"  # ids of the model's own tokenizer (lit_speed.run_contract.BatchSource)

    def __init__(self, root: str, tokenizer: Any, cache_dir: str, patterns: Sequence[str] = DEFAULT_PATTERNS,
                 block_size: int = 128, batch_size: int = 8, max_bytes: int = 4_000_000, val_every: int = 10,
                 train_stride: int | None = None, max_val_windows: int | str = "auto", num_workers: int | str = 0,
                 pin_memory: bool | str = "auto", persistent_workers: bool | None = None,
                 prefetch_factor: int | None = None, preload: bool = False,
                 batch_transform: Callable[[Any], Any] | None = None) -> None:
        patterns = [str(p) for p in patterns]  # plain strings: hyperparameters go into every checkpoint
        if max_val_windows != "auto" and (isinstance(max_val_windows, bool) or not isinstance(max_val_windows, int)):
            raise ValueError(f"TextFolderDataModule(max_val_windows={max_val_windows!r}): must be an int >= 1 or "
                             "'auto'. Fix: max_val_windows=auto (5% of the training tokens, one window per process to 256)")
        self.auto_val = max_val_windows == "auto"
        super().__init__(cache_dir, block_size, batch_size, max_bytes, val_every, train_stride,
                         AUTO_VAL_MAX_WINDOWS if self.auto_val else max_val_windows,
                         num_workers, root, pin_memory, persistent_workers, prefetch_factor, preload, batch_transform)
        self.save_hyperparameters(ignore=["batch_transform", "tokenizer"])
        self.tokenizer_source = tokenizer
        self.patterns = patterns
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if isinstance(self.tokenizer_source, (str, os.PathLike)):
                self._tokenizer = load_tokenizer(str(self.tokenizer_source))
            else:
                self._tokenizer = self.tokenizer_source
        return self._tokenizer

    def _build(self) -> Corpus:
        h = self.hparams
        return build_token_corpus(h.cache_dir, self.tokenizer, h.root, h.max_bytes, h.val_every, self.patterns)

    def prepare_data(self) -> None:
        self._build()

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is not None:
            return
        self.corpus = self._build()
        dtype = np.dtype(self.corpus.meta["dtype"])
        train = np.memmap(self.corpus.train_path, dtype=dtype, mode="r")
        val = np.memmap(self.corpus.val_path, dtype=dtype, mode="r")
        self._set_windows(train, val)

    def val_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        if self.auto_val and self.trainer is not None:  # the run's plan is known once the Trainer holds this module
            planned = planned_training_tokens(self.trainer, self.batch_size, self.block_size, len(self.train_dataset))
            processes = max(int(getattr(self.trainer, "world_size", 1) or 1), 1)
            self.val_dataset = self._val_subset(auto_val_windows(planned, self.block_size, processes))
        # the micro-batch: a model of real size holds batch x block x vocabulary logits per validation batch
        kwargs = {**self._loader_kwargs(), "persistent_workers": False}
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, **kwargs)

    def unigram_baseline(self) -> float:
        self.setup()
        dtype = np.dtype(self.corpus.meta["dtype"])
        return unigram_cross_entropy(np.memmap(self.corpus.train_path, dtype=dtype, mode="r"),
                                     np.memmap(self.corpus.val_path, dtype=dtype, mode="r"),
                                     vocab_size=self.corpus.meta["vocab_size"])

    def token_limits(self) -> TokenLimits:
        """The tokenizer's vocabulary (loaded now, and checked) and the window (``lit_speed.run_contract.TokenSource``)."""
        source = self.tokenizer_source if isinstance(self.tokenizer_source, (str, os.PathLike)) else \
            type(self.tokenizer_source).__name__
        return TokenLimits(len(self.tokenizer), self.block_size, f"tokenizer={source}",
                           positions_source=f"block_size={self.block_size}")

    def describe(self) -> dict[str, Any]:
        self.setup()
        m = self.corpus.meta
        return {"data": f"text folder {m['root']} ({m['content_hash']}): {m['train_tokens']:,} train / "
                        f"{m['val_tokens']:,} val tokens ({m['train_files']}/{m['val_files']} files), "
                        f"block {self.block_size}, vocab {m['vocab_size']:,}",
                "validation": (f"auto: {VAL_TOKEN_FRACTION:.0%} of the training tokens, one window per "
                               f"process to {AUTO_VAL_MAX_WINDOWS}" if self.auto_val else
                               f"{len(self.val_dataset)} windows") + f", batches of {self.batch_size}"}


__all__ = ["TextFolderDataModule", "TokenWindows", "build_token_corpus", "list_text_files"]
