"""A damaged data-bin is refused by name, with the fix, before fairseq reads it.

fairseq's binarised splits are pairs of files: ``SPLIT.idx`` (a header, then each sentence's length as
int32 and its byte offset in the ``.bin`` as int64) and ``SPLIT.bin`` (the token ids, back to back). fairseq
trusts both: a truncated ``.idx`` fails as ``'MMapIndexedDataset' object has no attribute
'_bin_buffer_mmap'``, a truncated ``.bin`` as numpy's ``offset must be non-negative and no greater than
buffer length``, and a dictionary that is not the data's as an index error deep in an embedding. Here,
when fairseq loads a split (``data_utils.load_indexed_dataset``, which every task calls):

* the index is checked against its own header (magic, version, dtype, length) and its offsets against its
  lengths, and the ``.bin``'s size against the offsets: truncated, extended, swapped or missing files;
* a split with no sentences is refused;
* with the split's dictionary, every token id must be one of its symbols (a dictionary of another size);
* a language pair's two sides must hold the same number of sentences (:func:`checked_language_pair`);
* a dictionary file must be there, UTF-8, non-empty and in fairseq's ``SYMBOL COUNT`` lines
  (:func:`checked_dictionary_file`); a split with one of its two files must have the other
  (:func:`checked_split_exists`).

Each failure is a :class:`DamagedDataError` naming the file, what is wrong and the fix (prepare the data
again). fairseq's ``.bin`` has no checksum: a changed byte that leaves a valid token id is not seen.
"""

import os
import struct
import weakref

import numpy as np

from moa.fairseq_fixes.named_errors import NamedInputError

MAGIC = b"MMIDIDX\x00\x00"  # fairseq's MMapIndexedDataset index
LEGACY_MAGIC = b"TNTIDX\x00\x00"  # fairseq's older IndexedDataset ("cached", "lazy"): left to fairseq
HEADER = len(MAGIC) + 8 + 1 + 8  # magic, version <Q, dtype code <B, sentences <Q
FIX = "prepare the data again (fairseq-preprocess, or the recipe that made this data-bin)"
_LOADED_FROM: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # dataset -> the prefix it was read from


class DamagedDataError(NamedInputError, RuntimeError):
    """A data-bin file that fairseq cannot read right: the file, what is wrong, the fix."""

    def __init__(self, path: str, reason: str, fix: str = FIX):
        super().__init__(path, reason, fix)
        self.path, self.reason, self.fix = path, reason, fix

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}. The data-bin is damaged or mixed up: {self.fix}"


def check_split_files(prefix: str) -> None:
    """Refuse a binarised split ``prefix`` (.idx and .bin) whose files are missing in part, truncated, extended
    or swapped. Nothing to check when neither file exists (fairseq then says the split is not found)."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if not os.path.exists(idx) and not os.path.exists(bin_):
        return
    check_pair_present(prefix)
    idx_bytes = os.path.getsize(idx)
    with open(idx, "rb") as f:
        header = f.read(HEADER)
    if not header:
        raise DamagedDataError(idx, "is empty (0 bytes): the write that made it did not finish")
    if header[:len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        return
    if header[:len(MAGIC)] != MAGIC:
        raise DamagedDataError(idx, f"is not a fairseq index: it starts with {header[:9]!r}, not {MAGIC!r} (a .bin "
                                    "or another file in its place?)")
    if len(header) < HEADER:
        raise DamagedDataError(idx, f"is truncated: {idx_bytes} bytes, shorter than its {HEADER}-byte header")
    version, code, sentences = struct.unpack("<QBQ", header[len(MAGIC):])
    from fairseq.data.indexed_dataset import _code_to_dtype

    if version != 1 or code not in _code_to_dtype:
        raise DamagedDataError(idx, f"has a damaged header (version {version}, dtype code {code})")
    if sentences == 0:  # fairseq cannot even map its empty .bin
        raise _empty_split(idx)
    expected = HEADER + 12 * sentences
    if idx_bytes != expected:
        what = "truncated" if idx_bytes < expected else "longer than its header says"
        raise DamagedDataError(idx, f"is {what}: its header counts {sentences:,} sentences, which take "
                                    f"{expected:,} bytes, and it has {idx_bytes:,}")
    index = np.memmap(idx, mode="r", offset=HEADER, dtype=np.uint8)
    lengths = np.frombuffer(index, dtype=np.int32, count=sentences)
    offsets = np.frombuffer(index, dtype=np.int64, count=sentences, offset=4 * sentences)
    itemsize = np.dtype(_code_to_dtype[code]).itemsize
    ends = np.cumsum(lengths.astype(np.int64)) * itemsize
    if (lengths < 0).any() or offsets[0] != 0 or not np.array_equal(offsets[1:], ends[:-1]):
        raise DamagedDataError(idx, "has sentence lengths and offsets that disagree: it was changed after it "
                                    "was written")
    data_bytes, bin_bytes = int(ends[-1]), os.path.getsize(bin_)
    if bin_bytes != data_bytes:
        what = "truncated" if bin_bytes < data_bytes else "longer than its index says"
        raise DamagedDataError(bin_, f"is {what}: {os.path.basename(idx)} counts {data_bytes:,} bytes of tokens "
                                     f"and it has {bin_bytes:,} (the .bin of another split, or a copy that did "
                                     f"not finish?)")


def check_pair_present(prefix: str) -> None:
    """Refuse a split ``prefix`` with one of its .idx and .bin there and the other missing."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for present, missing in ((idx, bin_), (bin_, idx)):
        if os.path.exists(present) and not os.path.exists(missing):
            raise DamagedDataError(missing, f"is missing beside {os.path.basename(present)}")


def checked_loading(load_indexed_dataset):
    """fairseq's ``data_utils.load_indexed_dataset``, with every shard's files checked first and the loaded
    split checked against its dictionary."""

    def wrapper(path, dictionary=None, dataset_impl=None, combine=False, default="cached"):
        shard = 0
        while True:
            prefix = path + (str(shard) if shard else "")
            if not os.path.exists(prefix + ".idx") and not os.path.exists(prefix + ".bin"):
                break
            check_split_files(prefix)
            if not combine:
                break
            shard += 1
        dataset = load_indexed_dataset(path, dictionary, dataset_impl, combine, default)
        if dataset is not None:
            _LOADED_FROM[dataset] = path
            check_loaded_split(path, dataset, dictionary)
        return dataset

    return wrapper


def check_loaded_split(path: str, dataset, dictionary) -> None:
    """A split with sentences, whose token ids are all symbols of ``dictionary`` (when given)."""
    if len(dataset) == 0:
        raise _empty_split(path + ".idx")
    if dictionary is None:
        return
    for part in [d for d in getattr(dataset, "datasets", [dataset]) if hasattr(d, "_bin_buffer")]:
        ids = np.frombuffer(part._bin_buffer, dtype=part._index.dtype)
        largest = int(ids.max()) if ids.size else 0
        if largest >= len(dictionary) or (ids.size and int(ids.min()) < 0):
            raise DamagedDataError(part._path + ".bin", f"holds token id {largest} but its dictionary has "
                                                        f"{len(dictionary):,} symbols: the dictionary is not the "
                                                        "one this data was binarised with, or the .bin is damaged")


def _empty_split(idx: str) -> DamagedDataError:
    return DamagedDataError(idx, "holds no sentences: it was binarised from an empty file",
                            "prepare the data again from a corpus with sentences in every split")


def _source_path(dataset):
    """The prefix a (possibly wrapped) dataset was loaded from, or None."""
    while dataset is not None:
        try:
            if dataset in _LOADED_FROM:
                return _LOADED_FROM[dataset]
        except TypeError:  # not weakly referenceable
            return None
        dataset = getattr(dataset, "dataset", None)
    return None


def checked_language_pair(language_pair_dataset_init):
    """fairseq's ``LanguagePairDataset.__init__``, refusing sides of different lengths by name (fairseq
    asserts ``Source and target must contain the same number of examples``)."""

    def wrapper(self, src, src_sizes, src_dict, tgt=None, *args, **kwargs):
        if tgt is not None and len(src) != len(tgt):
            source, target = _source_path(src) or "the source side", _source_path(tgt) or "the target side"
            raise DamagedDataError(f"{source} and {target}", f"hold {len(src):,} and {len(tgt):,} sentences: the "
                                   "two sides of a language pair must be binarised from line-aligned files",
                                   "prepare the data again from a parallel corpus whose two files have the same "
                                   "number of lines")
        return language_pair_dataset_init(self, src, src_sizes, src_dict, tgt, *args, **kwargs)

    return wrapper


def checked_split_exists(dataset_exists):
    """fairseq's ``indexed_dataset.dataset_exists``, which says a split whose .idx or .bin alone is missing
    does not exist (fairseq-train then stops with ``Dataset not found``): here the missing file is named."""

    def wrapper(path, impl):
        if impl in (None, "mmap", "cached", "lazy"):
            check_pair_present(path)
        return dataset_exists(path, impl)

    return wrapper


def checked_dictionary_file(add_from_file):
    """fairseq's ``Dictionary.add_from_file``: a dictionary file that is missing, not UTF-8, empty or not in
    ``SYMBOL COUNT`` lines is named (fairseq raises bare ``FileNotFoundError``, ``Exception`` or
    ``ValueError``); the dictionary remembers its file (``loaded_from``) for later messages."""

    def wrapper(self, f):
        if not isinstance(f, str) or "://" in f:
            return add_from_file(self, f)
        if not os.path.isfile(f):
            raise DamagedDataError(f, "is missing: a data-bin holds the dictionaries fairseq-preprocess wrote")
        if os.path.getsize(f) == 0:
            raise DamagedDataError(f, "is empty: it lists no symbols")
        try:
            add_from_file(self, f)
        except Exception as e:  # fairseq's ValueError, RuntimeError, or a bare Exception for a UnicodeError
            raise DamagedDataError(f, f"is not a fairseq dictionary ({str(e).strip()[:200]})") from None
        self.loaded_from = f

    return wrapper
