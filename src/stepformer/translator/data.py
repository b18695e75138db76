"""Chapter 11's data: Multi30k task 1, the raw captions, downloaded once, verified, read line by line.

Each split is one gzipped UTF-8 file per language, one caption a line; line N of every language
is the same caption. :func:`fetch` gives one verified file, from a local folder or from the cache
(downloading it there when needed); :func:`load_split` gives the aligned sentences of two
languages. Every problem with the data is a :class:`DataError` whose one-line message names the
file and what is wrong with it.
"""

import gzip
import hashlib
import os
import sys
import zlib
from pathlib import Path

import pooch

SPLITS = ("train", "val", "test_2016_flickr")
LANGUAGES = ("de", "en", "fr")
BASE_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"

# The upstream files' sums, as in the shared SHA256SUMS (a test keeps the two equal).
SHA256 = {
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}

CITATION = (
    "Desmond Elliott, Stella Frank, Khalil Sima'an, Lucia Specia (2016). Multi30K: Multilingual "
    "English-German Image Descriptions. Proceedings of the 5th Workshop on Vision and Language, "
    "pages 70-74. French data: Desmond Elliott, Stella Frank, Loïc Barrault, Fethi Bougares, Lucia "
    "Specia (2017). Findings of the Second Shared Task on Multimodal Machine Translation and "
    "Multilingual Image Description. Proceedings of the Second Conference on Machine Translation "
    "(WMT17), pages 215-233."
)

TERMS = (
    "Multi30k is provided for non-commercial research and educational use; its captions derive "
    "from Flickr30K. The terms are in the upstream README (https://github.com/multi30k/dataset), "
    'section "Use of the data".'
)

SUMS_FILE = "SHA256SUMS"


class DataError(ValueError):
    """Bad or missing data: the message is one line that names the file and the problem."""


# The terms are shown where the data is downloaded, once per process rather than once per file.
_terms_shown = False


def default_cache_dir() -> Path:
    """Where downloads go: ``$STEPFORMER_DATA_CACHE/multi30k`` if set, else the user cache's ``stepformer/multi30k``."""
    root = os.environ.get("STEPFORMER_DATA_CACHE")
    return (Path(root).expanduser() if root else Path(pooch.os_cache("stepformer"))) / "multi30k"


def fetch(
    split: str,
    language: str,
    data_dir: Path | str | None = None,
    cache_dir: Path | str | None = None,
    base_url: str | None = None,
    progress: bool = True,
) -> Path:
    """The path of the verified file ``<split>.<language>.gz``.

    With ``data_dir``, the file in that folder, checked against the folder's own ``SHA256SUMS`` if it
    has one, else against :data:`SHA256`; nothing is downloaded. Without it, the file in
    ``cache_dir`` (default :func:`default_cache_dir`), downloaded from ``base_url`` (default
    ``$STEPFORMER_MULTI30K_URL``, else :data:`BASE_URL`) when missing or damaged.
    """
    name = _file_name(split, language)
    if data_dir is not None:
        return _local_file(Path(data_dir).expanduser(), name)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    url = base_url or os.environ.get("STEPFORMER_MULTI30K_URL") or BASE_URL
    return _download(url.rstrip("/") + "/" + name, cache / name, progress)


def read_lines(path: Path) -> list[str]:
    """The lines of a gzipped UTF-8 file, exactly: split on ``"\\n"`` only, final newline dropped, nothing stripped.

    Raises :class:`DataError` for an unreadable, truncated or corrupt gzip, bytes that are not
    UTF-8, an empty file, and an empty (or whitespace-only) line.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot be read: {_one_line(error)}") from error
    try:
        data = gzip.decompress(raw)
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise DataError(f"{path}: truncated or corrupt gzip ({_one_line(error)})") from error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1)
        raise DataError(
            f"{path}: not UTF-8 at line {line}, byte offset {error.start} of the uncompressed text "
            f"(byte {column} of the line): {error.reason}"
        ) from error
    if not text:
        raise DataError(f"{path}: the file is empty (no lines)")
    # Not str.splitlines(): it also breaks at \x85, \u2028, \x0c ..., which would split one caption
    # into two and misalign the languages.
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            problem = "is empty" if not line else "holds only whitespace"
            raise DataError(f"{path}: line {number} {problem}; every line must be a sentence")
    return lines


def load_split(
    split: str,
    src_lang: str,
    tgt_lang: str,
    data_dir: Path | str | None = None,
    cache_dir: Path | str | None = None,
    base_url: str | None = None,
    progress: bool = True,
) -> tuple[list[str], list[str]]:
    """The aligned sentences ``(source, target)`` of one split: line i of each is the same caption.

    ``data_dir``, ``cache_dir``, ``base_url`` and ``progress`` are :func:`fetch`'s.
    """
    # Both names are checked before anything is downloaded.
    src_name, _ = _file_name(split, src_lang), _file_name(split, tgt_lang)
    if src_lang == tgt_lang:
        raise DataError(f"{src_name}: source and target language are both {src_lang!r}; choose two different ones")
    where = {"data_dir": data_dir, "cache_dir": cache_dir, "base_url": base_url, "progress": progress}
    src_path, tgt_path = fetch(split, src_lang, **where), fetch(split, tgt_lang, **where)
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise DataError(
            f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}: "
            f"the languages of a split must align line by line"
        )
    return src, tgt


def _file_name(split: str, language: str) -> str:
    """``<split>.<language>.gz``, once both are known ones."""
    name = f"{split}.{language}.gz"
    if split not in SPLITS:
        raise DataError(f"{name}: unknown split {split!r}; the splits are {', '.join(SPLITS)}")
    if language not in LANGUAGES:
        raise DataError(f"{name}: unknown language {language!r}; the languages are {', '.join(LANGUAGES)}")
    return name


def _local_file(folder: Path, name: str) -> Path:
    """The verified file ``name`` in a local data folder."""
    path = folder / name
    if not folder.is_dir():
        raise DataError(f"{path}: the data folder {folder} does not exist; it must hold <split>.<lang>.gz files")
    if not path.is_file():
        raise DataError(f"{path}: missing; the data folder {folder} must hold <split>.<lang>.gz files, here {name}")
    sums_path = folder / SUMS_FILE
    # A folder's own sums let an instructor use a cleaned copy; without them it must be the upstream data.
    if sums_path.exists():
        sums, source = _read_sums(sums_path), str(sums_path)
        if name not in sums:
            raise DataError(f"{path}: not listed in {sums_path}, which holds this folder's checksums")
    else:
        sums, source = SHA256, "the built-in checksums"
    got = _sha256(path)
    if got != sums[name]:
        raise DataError(
            f"{path}: checksum mismatch: sha256 expected {sums[name][:12]}... ({source}), got {got[:12]}...; "
            f"the file is damaged or not the one expected"
        )
    return path


def _download(url: str, target: Path, progress: bool) -> Path:
    """``target``, verified, downloaded from ``url`` by pooch unless the cache already holds it."""
    expected = SHA256[target.name]
    if target.is_file() and _sha256(target) == expected:
        return target
    _show_terms_once()
    folder = target.parent
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        # pooch streams into a temporary file beside the target and moves it only after the hash check.
        found = pooch.retrieve(
            url, known_hash=f"sha256:{expected}", fname=target.name, path=folder, progressbar=progress
        )
    except BaseException as error:
        _remove_leftovers(folder, before, target, expected)
        # requests' errors are OSErrors; pooch reports a hash mismatch as a ValueError.
        if isinstance(error, ValueError | OSError):
            raise DataError(f"{url}: download into {folder} failed: {_one_line(error)}") from error
        raise
    return Path(found)


def _remove_leftovers(folder: Path, before: set[Path], target: Path, expected: str) -> None:
    """Remove what a failed download left in the cache: a temporary file, a cached copy that fails its check."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        # pooch deletes its temporary file ("tmp..." from tempfile) itself; this covers a path where it could not.
        if entry not in before and entry.name.startswith("tmp") and entry.is_file():
            entry.unlink(missing_ok=True)
    # The damaged cached copy that caused the download must not stay behind looking like data.
    if target.is_file() and _sha256(target) != expected:
        target.unlink(missing_ok=True)


def _read_sums(sums_path: Path) -> dict[str, str]:
    """File name -> sha256 from a ``sha256sum``-style file (``<hex>  <name>`` per line)."""
    try:
        text = sums_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{sums_path}: cannot be read: {_one_line(error)}") from error
    sums = {}
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        digest, _, name = line.strip().partition(" ")
        # sha256sum writes "<hex>  <name>", or "<hex> *<name>" in binary mode.
        name = name.lstrip(" *")
        if len(digest) != 64 or not all(c in "0123456789abcdefABCDEF" for c in digest) or not name:
            raise DataError(f"{sums_path}: line {number} is not '<sha256 hex>  <file name>'")
        sums[name] = digest.lower()
    return sums


def _sha256(path: Path) -> str:
    """The sha256 hex digest of a file."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _show_terms_once() -> None:
    """Print the data's terms and citation to stderr, the first time in this process."""
    global _terms_shown
    if not _terms_shown:
        print(f"{TERMS}\nPlease cite: {CITATION}", file=sys.stderr)
        _terms_shown = True


def _one_line(error: BaseException) -> str:
    """An exception as one line: its type and its message with every run of whitespace made one space."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"
