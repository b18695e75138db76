"""Chapter 11's data loader on the real Multi30k files, on damaged copies of them, and over loopback HTTP.

The real files live beside the project (``../shared/data/multi30k``), never in it; downloads are
served from a temporary folder by a server on 127.0.0.1, so nothing here reaches the internet.
"""

import contextlib
import gzip
import hashlib
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pooch
import pytest

from stepformer.translator import data
from stepformer.translator.data import DataError, fetch, load_split, read_lines

PAIRS = {"train": 29000, "val": 1014, "test_2016_flickr": 1000}


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process would: terms not shown yet, no URL or cache override, no proxy."""
    monkeypatch.setattr(data, "_terms_shown", False)
    for name in ("STEPFORMER_MULTI30K_URL", "STEPFORMER_DATA_CACHE", "HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    # A proxy in the environment must never see the loopback server's requests.
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")


def one_line(error: pytest.ExceptionInfo[DataError]) -> str:
    """The error's message, after checking that it is a single line."""
    message = str(error.value)
    assert "\n" not in message, f"the message should be one line: {message!r}"
    return message


def write_gz(folder: Path, name: str, text: bytes) -> Path:
    """A gzip file ``folder/name`` holding ``text``."""
    path = folder / name
    path.write_bytes(gzip.compress(text, mtime=0))
    return path


def write_sums(folder: Path) -> None:
    """A SHA256SUMS in ``folder`` that matches its .gz files, so the checks after the checksum are reached."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(folder.glob("*.gz"))]
    (folder / "SHA256SUMS").write_text("".join(lines))


# --- the real data ---


@pytest.mark.parametrize("split", list(PAIRS))
def test_real_splits_have_their_published_sizes(real_data: Path, split: str) -> None:
    de, en = load_split(split, "de", "en", data_dir=real_data)
    fr, en_again = load_split(split, "fr", "en", data_dir=real_data)
    assert len(de) == len(en) == len(fr) == PAIRS[split]
    assert en_again == en
    if split == "train":
        assert de[0] == "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche."
        assert en[0] == "Two young, White males are outside near many bushes."
        assert fr[0] == "Deux jeunes hommes blancs sont dehors près de buissons."


def test_builtin_sums_equal_the_shared_sums_file(real_data: Path) -> None:
    assert data.SHA256 == data._read_sums(real_data / "SHA256SUMS")
    assert set(data.SHA256) == {f"{s}.{lang}.gz" for s in data.SPLITS for lang in data.LANGUAGES}


def test_local_folder_without_sums_is_checked_against_the_builtin_ones(real_data: Path, tmp_path: Path) -> None:
    shutil.copy(real_data / "val.de.gz", tmp_path / "val.de.gz")
    assert fetch("val", "de", data_dir=tmp_path) == tmp_path / "val.de.gz"
    damaged = tmp_path / "val.de.gz"
    damaged.write_bytes(damaged.read_bytes() + b"\0")
    with pytest.raises(DataError) as error:
        fetch("val", "de", data_dir=tmp_path)
    message = one_line(error)
    assert str(damaged) in message and "checksum mismatch" in message and "built-in" in message
    assert data.SHA256["val.de.gz"][:12] in message


def test_local_folder_is_not_downloaded_from(real_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "cache"
    # An unroutable URL: any attempt to download would fail the call.
    src, tgt = load_split("val", "de", "en", data_dir=real_data, cache_dir=cache, base_url="http://127.0.0.1:9/")
    assert len(src) == len(tgt) == PAIRS["val"]
    assert not cache.exists()
    assert data.TERMS not in capsys.readouterr().err


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert data.default_cache_dir() == Path(pooch.os_cache("stepformer")) / "multi30k"
    monkeypatch.setenv("STEPFORMER_DATA_CACHE", str(tmp_path))
    assert data.default_cache_dir() == tmp_path / "multi30k"


# --- reading lines ---


def test_read_lines_splits_on_newline_only_and_strips_nothing(tmp_path: Path) -> None:
    # \x85, \u2028 and \x0c are line breaks to str.splitlines(), but inside a caption they are characters.
    path = write_gz(tmp_path, "x.gz", " Ein Hund\x85läuft.\n\tZwei\u2028Katzen \x0c\nDrei Vögel.\r\n".encode())
    assert read_lines(path) == [" Ein Hund\x85läuft.", "\tZwei\u2028Katzen \x0c", "Drei Vögel.\r"]
    no_final_newline = write_gz(tmp_path, "y.gz", b"one\ntwo")
    assert read_lines(no_final_newline) == ["one", "two"]


# --- bad data: each problem is one line that names the file ---


@pytest.mark.parametrize(
    ("split", "src", "tgt", "expected"),
    [
        ("training", "de", "en", ["training.de.gz", "unknown split 'training'", "train, val, test_2016_flickr"]),
        ("val", "de", "cs", ["val.cs.gz", "unknown language 'cs'", "de, en, fr"]),
        ("val", "en", "en", ["val.en.gz", "both 'en'"]),
    ],
)
def test_bad_names(tmp_path: Path, split: str, src: str, tgt: str, expected: list[str]) -> None:
    with pytest.raises(DataError) as error:
        load_split(split, src, tgt, data_dir=tmp_path)
    message = one_line(error)
    for part in expected:
        assert part in message


def test_missing_file_and_missing_folder(tmp_path: Path) -> None:
    write_gz(tmp_path, "val.de.gz", b"Ein Hund.\n")
    write_sums(tmp_path)
    with pytest.raises(DataError) as error:
        load_split("val", "de", "en", data_dir=tmp_path)
    message = one_line(error)
    assert str(tmp_path / "val.en.gz") in message and "missing" in message and "<split>.<lang>.gz" in message
    nowhere = tmp_path / "nowhere"
    with pytest.raises(DataError) as error:
        fetch("val", "de", data_dir=nowhere)
    message = one_line(error)
    assert str(nowhere / "val.de.gz") in message and "does not exist" in message


def test_folder_sums_replace_the_builtin_ones(tmp_path: Path) -> None:
    path = write_gz(tmp_path, "val.de.gz", b"Ein Hund.\n")
    write_sums(tmp_path)
    assert fetch("val", "de", data_dir=tmp_path) == path
    path.write_bytes(gzip.compress(b"Eine Katze.\n", mtime=0))
    with pytest.raises(DataError) as error:
        fetch("val", "de", data_dir=tmp_path)
    message = one_line(error)
    assert str(path) in message and "checksum mismatch" in message and str(tmp_path / "SHA256SUMS") in message
    assert hashlib.sha256(path.read_bytes()).hexdigest()[:12] in message


def test_bad_sums_file(tmp_path: Path) -> None:
    write_gz(tmp_path, "val.de.gz", b"Ein Hund.\n")
    sums = tmp_path / "SHA256SUMS"
    sums.write_text(f"{'0' * 64}  val.en.gz\n")
    with pytest.raises(DataError) as error:
        fetch("val", "de", data_dir=tmp_path)
    message = one_line(error)
    assert str(tmp_path / "val.de.gz") in message and "not listed" in message
    sums.write_text(f"{'0' * 64}  val.en.gz\nnot a sum\n")
    with pytest.raises(DataError) as error:
        fetch("val", "de", data_dir=tmp_path)
    message = one_line(error)
    assert str(sums) in message and "line 2" in message


@pytest.mark.parametrize("damage", ["truncated", "flipped", "not gzip"])
def test_corrupt_gzip(real_data: Path, tmp_path: Path, damage: str) -> None:
    good = (real_data / "val.de.gz").read_bytes()
    middle = len(good) // 2
    bad = {
        "truncated": good[:middle],
        "flipped": good[:middle] + bytes([good[middle] ^ 0xFF]) + good[middle + 1 :],
        "not gzip": b"Ein Hund.\n",
    }[damage]
    (tmp_path / "val.de.gz").write_bytes(bad)
    shutil.copy(real_data / "val.en.gz", tmp_path / "val.en.gz")
    write_sums(tmp_path)
    with pytest.raises(DataError) as error:
        load_split("val", "de", "en", data_dir=tmp_path)
    message = one_line(error)
    assert str(tmp_path / "val.de.gz") in message and "truncated or corrupt gzip" in message


def test_not_utf8_names_line_and_byte(tmp_path: Path) -> None:
    write_gz(tmp_path, "val.de.gz", b"Ein Hund.\nZwei Hunde \xff laufen.\n")
    write_gz(tmp_path, "val.en.gz", b"A dog.\nTwo dogs run.\n")
    write_sums(tmp_path)
    with pytest.raises(DataError) as error:
        load_split("val", "de", "en", data_dir=tmp_path)
    message = one_line(error)
    offset = len(b"Ein Hund.\nZwei Hunde ")
    assert str(tmp_path / "val.de.gz") in message and "not UTF-8" in message
    assert "line 2" in message and f"byte offset {offset}" in message


@pytest.mark.parametrize(("text", "line"), [(b"Ein Hund.\n\nDrei.\n", 2), (b"Ein Hund.\nZwei.\n \t\n", 3), (b"", None)])
def test_empty_line_or_file(tmp_path: Path, text: bytes, line: int | None) -> None:
    path = write_gz(tmp_path, "val.en.gz", text)
    write_sums(tmp_path)
    with pytest.raises(DataError) as error:
        read_lines(fetch("val", "en", data_dir=tmp_path))
    message = one_line(error)
    assert str(path) in message
    assert (f"line {line} " if line else "the file is empty") in message


def test_unequal_line_counts_name_both_files(tmp_path: Path) -> None:
    write_gz(tmp_path, "val.de.gz", b"Ein Hund.\nZwei Hunde.\nDrei Hunde.\n")
    write_gz(tmp_path, "val.en.gz", b"A dog.\nTwo dogs.\n")
    write_sums(tmp_path)
    with pytest.raises(DataError) as error:
        load_split("val", "de", "en", data_dir=tmp_path)
    message = one_line(error)
    assert f"{tmp_path / 'val.de.gz'} has 3 lines" in message and f"{tmp_path / 'val.en.gz'} has 2" in message


# --- downloads over loopback HTTP ---


@dataclass
class Server:
    """A loopback HTTP server over ``folder``: the paths it was asked for, and those it cuts off mid-file."""

    url: str
    folder: Path
    requests: list[str] = field(default_factory=list)
    cut_off: set[str] = field(default_factory=set)


@pytest.fixture
def server(real_data: Path, tmp_path: Path) -> Iterator[Server]:
    """Serve copies of the real val files from 127.0.0.1 on a free port."""
    folder = tmp_path / "served"
    folder.mkdir()
    for name in ("val.de.gz", "val.en.gz"):
        shutil.copy(real_data / name, folder / name)
    state = Server(url="", folder=folder)

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self) -> None:
            state.requests.append(self.path)
            if self.path not in state.cut_off:
                super().do_GET()
                return
            # The whole length announced, half of the bytes sent: a connection lost mid-download.
            body = (folder / self.path.lstrip("/")).read_bytes()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True

        def log_message(self, format: str, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/"
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_download_verifies_and_caches(server: Server, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "cache"
    path = fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    assert path == cache / "val.de.gz"
    assert path.read_bytes() == (server.folder / "val.de.gz").read_bytes()
    assert server.requests == ["/val.de.gz"]
    assert fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False) == path
    assert server.requests == ["/val.de.gz"], "a verified cached file must not be downloaded again"
    de, en = load_split("val", "de", "en", cache_dir=cache, base_url=server.url, progress=False)
    assert len(de) == len(en) == PAIRS["val"]
    assert server.requests == ["/val.de.gz", "/val.en.gz"]
    err = capsys.readouterr().err
    assert err.count(data.TERMS) == 1 and err.count(data.CITATION) == 1, "the terms are shown once per process"
    assert sorted(p.name for p in cache.iterdir()) == ["val.de.gz", "val.en.gz"]


def test_url_from_environment(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEPFORMER_MULTI30K_URL", server.url.rstrip("/"))
    monkeypatch.setenv("STEPFORMER_DATA_CACHE", str(tmp_path / "cache"))
    path = fetch("val", "en", progress=False)
    assert path == tmp_path / "cache" / "multi30k" / "val.en.gz"
    assert server.requests == ["/val.en.gz"]


def test_corrupt_download_leaves_nothing(server: Server, tmp_path: Path) -> None:
    served = server.folder / "val.de.gz"
    served.write_bytes(served.read_bytes()[:-10] + b"0123456789")
    cache = tmp_path / "cache"
    url = server.url + "val.de.gz"
    with pytest.raises(DataError) as error:
        fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    message = one_line(error)
    assert url in message and "hash" in message
    assert list(cache.iterdir()) == [], "neither the file nor pooch's temporary file may stay in the cache"
    # A damaged cached copy is not left behind either when its replacement fails the check.
    (cache / "val.de.gz").write_bytes(b"damaged")
    with pytest.raises(DataError):
        fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    assert list(cache.iterdir()) == []


def test_leftover_temporary_file_is_removed(server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    @contextlib.contextmanager
    def leaky_temporary_file(path: str | None = None) -> Iterator[str]:
        # pooch's own, without the clean-up: as if it were interrupted before deleting its download.
        with tempfile.NamedTemporaryFile(delete=False, dir=path) as tmp:
            pass
        yield tmp.name

    monkeypatch.setattr(pooch.core, "temporary_file", leaky_temporary_file)
    served = server.folder / "val.de.gz"
    served.write_bytes(served.read_bytes() + b"\0")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tmp_older").write_bytes(b"not this call's")
    with pytest.raises(DataError):
        fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    assert [p.name for p in cache.iterdir()] == ["tmp_older"], "only this download's temporary file is removed"


def test_connection_lost_mid_download_leaves_nothing(server: Server, tmp_path: Path) -> None:
    server.cut_off.add("/val.de.gz")
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as error:
        fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    assert server.url + "val.de.gz" in one_line(error)
    assert list(cache.iterdir()) == []


def test_unreachable_server(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The port was free a moment ago and nothing listens on it now: the connection is refused.
    url = f"http://127.0.0.1:{port}/"
    with pytest.raises(DataError) as error:
        fetch("val", "de", cache_dir=tmp_path / "cache", base_url=url, progress=False)
    message = one_line(error)
    assert url + "val.de.gz" in message and "ConnectionError" in message


def test_cached_file_damaged_on_disk_is_downloaded_again(server: Server, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False)
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    assert fetch("val", "de", cache_dir=cache, base_url=server.url, progress=False) == path
    assert path.read_bytes() == good
    assert server.requests == ["/val.de.gz", "/val.de.gz"]
    assert len(read_lines(path)) == PAIRS["val"]
