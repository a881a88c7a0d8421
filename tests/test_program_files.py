"""Program and data files: checked before the ExecuTorch runtime reads them, so that no file aborts the process,
and written whole, so that an interrupted export leaves no part of a file under the final name.

Fast: the header checks against headers laid out by ExecuTorch's own writers (`_ExtendedHeader` and
`_insert_flatbuffer_header` for a program, `FlatTensorSerializer` for an adapter file), every kind of bad file, and
`write_whole` interrupted in a subprocess by a file size limit (the write fails, or SIGXFSZ kills the process).
Slow: a demo program with a LoRA slot exported once; random bytes, a truncated program, an empty file, a
directory and files of the wrong kind given to `Runner` (as the program, its data file or an adapter) in a
subprocess, and to `etblocks run` (exit code 2 and one `error:` line, never a signal); an export whose process is
killed while it writes the program.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from etblocks.adapters.files import read_adapter_file, save_adapter_file
from etblocks.adapters.lora import LoRATensors
from etblocks.errors import AdapterMismatchError, ConfigError, EtblocksError, ProgramFileError
from etblocks.program_files import check_data_file, check_program_file, write_whole

MAX_SEQ_LEN = 32
ADAPTER_TARGET = "model.layers.0.self_attn.q_proj"


def random_bytes(size: int = 65536) -> bytes:
    data = random.Random(0).randbytes(size)
    assert data[4:6] not in (b"ET", b"FT")  # no identifier by chance
    return data


def program_bytes(segment_size: int = 1000) -> tuple[bytes, int]:
    """A program file's head and segments as ExecuTorch's serializer lays them out (a stand-in flatbuffer behind
    the real header writer), and the size its header declares, as ExecuTorch's reader reads it."""
    from executorch.exir._serialize._program import _ExtendedHeader, _get_extended_header, _insert_flatbuffer_header

    flatbuffer = (8).to_bytes(4, "little") + b"ET12" + bytes(88)
    program_size = len(flatbuffer) + _ExtendedHeader.EXPECTED_LENGTH
    header = _ExtendedHeader(program_size=program_size, segment_base_offset=128, segment_data_size=segment_size)
    data = _insert_flatbuffer_header(flatbuffer, r"ET[0-9a-zA-Z][0-9a-zA-Z]", header.to_bytes())
    data += bytes(128 - len(data)) + bytes(range(256)) * (segment_size // 256) + bytes(segment_size % 256)
    parsed = _get_extended_header(data)
    assert parsed is not None and parsed.program_size == program_size
    return data, parsed.segment_base_offset + parsed.segment_data_size


def adapter_file(path: Path) -> Path:
    return save_adapter_file({ADAPTER_TARGET: LoRATensors(torch.randn(2, 64), torch.randn(64, 2), 1.0)}, path)


def foreign_flat_tensor(path: Path) -> Path:
    """A sound FlatTensor file whose tensor is not a LoRA matrix."""
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    tensor = torch.arange(8, dtype=torch.float32)
    payload = DataPayload(
        buffers=[tensor.view(torch.uint8).numpy().tobytes()],
        named_data={"embedding.weight": DataEntry(0, 16, TensorLayout.from_tensor(tensor))},
    )
    path.write_bytes(bytes(FlatTensorSerializer().serialize(payload)))
    return path


# ------------------------------------------------------------------------------------------ header checks


def test_sound_files_pass_and_one_byte_short_is_truncated(tmp_path):
    """The size each check requires is exactly what ExecuTorch's own readers read from the header."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader

    data, declared = program_bytes()
    assert len(data) == declared
    program = tmp_path / "p.pte"
    program.write_bytes(data)
    assert check_program_file(program) == program
    program.write_bytes(data[:-1])
    with pytest.raises(ProgramFileError, match=rf"p\.pte is truncated: its header declares {declared} bytes, the file holds {declared - 1}; expected an ExecuTorch program"):
        check_program_file(program)

    adapter = adapter_file(tmp_path / "a.ptd")
    data = adapter.read_bytes()
    header = FlatTensorHeader.from_bytes(data[8:])
    assert header.is_valid() and len(data) == header.segment_base_offset + header.segment_data_size
    assert check_data_file(adapter) == adapter
    adapter.write_bytes(data[:-1])
    with pytest.raises(ProgramFileError, match=rf"a\.ptd is truncated: its header declares {len(data)} bytes, the file holds {len(data) - 1}"):
        check_data_file(adapter)


def bad_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.bin"
    program, _ = program_bytes()
    contents = {
        "random": random_bytes(),
        "empty": b"",
        "short": program[:40],
        "newer version": program[:4] + b"ET13" + program[8:],
        "corrupt header": program[:12] + (8).to_bytes(4, "little") + program[16:],
    }
    if kind == "directory":
        path.mkdir()
    elif kind == "data file":
        adapter_file(path)
    elif kind == "program":
        path.write_bytes(program)
    elif kind != "missing":
        path.write_bytes(contents[kind])
    return path


PROBLEMS = {
    "random": r"is not an ExecuTorch file \(bytes 4-8 are b'.*', not the identifier b'ET12'\)",
    "empty": "is empty",
    "short": "holds 40 bytes, fewer than the 64 of an ExecuTorch file's head",
    "newer version": r"is from another ExecuTorch format version \(file identifier b'ET13'; this runtime reads b'ET12'\); "
    "export it again with the installed ExecuTorch",
    "corrupt header": r"has a corrupt header \(its length field says 8 bytes, at least 24 are needed\)",
    "directory": "is a directory",
    "missing": "does not exist",
    "data file": r"is an ExecuTorch data file \(\.ptd\)",
}


@pytest.mark.parametrize("kind", PROBLEMS)
def test_bad_program_files_are_named_with_what_is_wrong(tmp_path, kind):
    path = bad_file(tmp_path, kind)
    with pytest.raises(ProgramFileError, match=rf"^{re.escape(str(path))} {PROBLEMS[kind]}; expected an ExecuTorch program \(\.pte\)") as caught:
        check_program_file(path)
    assert isinstance(caught.value, ConfigError)  # a path option holding a value etblocks does not accept


@pytest.mark.parametrize("kind", ["random", "empty", "directory", "missing", "program"])
def test_bad_adapter_files_are_refused_before_parsing(tmp_path, kind):
    path = bad_file(tmp_path, kind)
    problem = PROBLEMS.get(kind, r"is an ExecuTorch program \(\.pte\)").replace("ET12", "FT01")
    with pytest.raises(ProgramFileError, match=rf"^{re.escape(str(path))} {problem}; expected an etblocks adapter file \(\.ptd with lora_A/lora_B tensors\)$"):
        read_adapter_file(path)


def test_adapter_file_round_trip_and_foreign_flat_tensor(tmp_path):
    tensors = read_adapter_file(adapter_file(tmp_path / "a.ptd"))
    assert list(tensors) == [ADAPTER_TARGET] and tensors[ADAPTER_TARGET].lora_A.shape == (2, 64)
    foreign = foreign_flat_tensor(tmp_path / "weights.ptd")
    assert check_data_file(foreign) == foreign  # a sound data file, just not an adapter
    with pytest.raises(AdapterMismatchError, match=r"weights\.ptd is not an etblocks adapter file .*'embedding\.weight'"):
        read_adapter_file(foreign)


def test_program_without_extended_header_is_checked_by_its_root_offset(tmp_path):
    """A program without segments has no extended header: the whole file is the flatbuffer."""
    path = tmp_path / "flat.pte"
    path.write_bytes((60).to_bytes(4, "little") + b"ET12" + bytes(56))
    assert check_program_file(path) == path
    path.write_bytes((200).to_bytes(4, "little") + b"ET12" + bytes(56))
    with pytest.raises(ProgramFileError, match=r"flat\.pte is truncated: its root table offset needs 204 bytes, the file holds 64"):
        check_program_file(path)


# ------------------------------------------------------------------------------------------ writing whole


def test_write_whole_replaces_the_file_with_the_usual_mode(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    path = tmp_path / "sub" / "model.pte"
    assert write_whole(path, b"first") == path and path.read_bytes() == b"first"
    assert write_whole(path, bytearray(b"second")) == path and path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pte"]
    assert path.stat().st_mode == plain.stat().st_mode


WRITE_UNDER_LIMIT = """
import resource, signal, sys
from etblocks.program_files import write_whole
path, limit, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "killed":
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (the write fails); by default it kills
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
write_whole(path, bytes(range(256)) * 4096)
"""


@pytest.mark.parametrize("previous", [b"the previous program", None], ids=["previous file", "no file"])
@pytest.mark.parametrize("mode", ["killed", "raised"])
def test_write_interrupted_midway_leaves_the_previous_file_or_none(tmp_path, mode, previous):
    """A file size limit of 64 KiB stops the 1 MiB write partway, every time: the process is killed (SIGXFSZ) or
    the write raises. Under the final name stays the previous file, or nothing."""
    path = tmp_path / "model.pte"
    if previous is not None:
        path.write_bytes(previous)
    limit = 65536
    proc = subprocess.run([sys.executable, "-c", WRITE_UNDER_LIMIT, str(path), str(limit), mode], capture_output=True, text=True, timeout=120)
    partial = [p for p in tmp_path.iterdir() if p.name != "model.pte"]
    if mode == "killed":
        assert proc.returncode == -signal.SIGXFSZ, proc.stderr
        assert [p.name.startswith(".model.pte.") and p.name.endswith(".partial") for p in partial] == [True]
        assert partial[0].stat().st_size == limit  # killed while writing it
    else:
        assert proc.returncode == 1 and "File too large" in proc.stderr, proc.stderr
        assert partial == []
    if previous is None:
        assert not path.exists()
    else:
        assert path.read_bytes() == previous


# ------------------------------------------------------------------------------------------ real programs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The demo model with one PEFT adapter, exported once (XNNPACK, so the program has segments and an extended
    header), and bad files beside it."""
    from peft_refs import make_adapter

    import etblocks
    from etblocks.demo import demo_model

    root = tmp_path_factory.mktemp("program-files")
    base = demo_model(seed=0)
    make_adapter(base, root / "peft", 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = etblocks.swap(base, backend="xnnpack", max_seq_len=MAX_SEQ_LEN)
    etblocks.load_adapter(model, root / "peft", name="A")
    result = etblocks.export(model, backend="xnnpack", out=root / "demo.pte")
    program, adapter = result.path, result.adapters["A"]
    bad = root / "bad"
    bad.mkdir()
    data = program.read_bytes()
    (bad / "random.pte").write_bytes(random_bytes())
    (bad / "truncated.pte").write_bytes(data[: len(data) // 2])
    (bad / "empty.pte").write_bytes(b"")
    (bad / "directory.pte").mkdir()
    (bad / "random.ptd").write_bytes(random_bytes())
    (bad / "truncated.ptd").write_bytes(adapter.read_bytes()[:-16])
    (bad / "empty.ptd").write_bytes(b"")
    (bad / "directory.ptd").mkdir()
    foreign_flat_tensor(bad / "weights.ptd")
    corrupt = bytearray(data)  # a sound header over a flatbuffer the runtime's verifier refuses
    corrupt[200:12000:7] = bytes(b ^ 0xFF for b in corrupt[200:12000:7])
    (bad / "corrupt.pte").write_bytes(corrupt)
    assert data.count(b"XnnpackBackend") >= 1  # a delegate this runtime does not have: same length, sound file
    (bad / "unknown-delegate.pte").write_bytes(data.replace(b"XnnpackBackend", b"XnnpackBackenX"))
    return program, adapter, bad


RUNNER_CASES = """
import json, sys
import etblocks
from etblocks.errors import EtblocksError

program = sys.argv[1]
for label, call, path in json.loads(sys.argv[2]):
    try:
        if call == "program":
            runner = etblocks.Runner(path)
        elif call == "data_path":
            runner = etblocks.Runner(program, data_path=path)
        elif call == "adapters":
            runner = etblocks.Runner(program, adapters={"A": path})
        else:
            etblocks.Runner(program).add_adapter("A", path)
        outcome = ["loaded", ""]
    except EtblocksError as exc:
        outcome = [type(exc).__name__, str(exc)]
    print(json.dumps([label, *outcome]), flush=True)
"""

NOT_PROGRAM = r"is not an ExecuTorch file \(bytes 4-8 are .*\); expected "
RUNTIME_REFUSED = r"could not be loaded by the ExecuTorch runtime \(RuntimeError: Failed to load program, error: 0x:\w+\); expected"
PROGRAM_CASES = {  # file under bad/ (or the adapter): what the message says after the file's path
    "random.pte": NOT_PROGRAM + "an ExecuTorch program",
    "truncated.pte": r"is truncated: its header declares \d+ bytes, the file holds \d+; expected an ExecuTorch program",
    "empty.pte": "is empty; expected an ExecuTorch program",
    "directory.pte": "is a directory; expected an ExecuTorch program",
    "adapter": r"is an ExecuTorch data file \(\.ptd\); expected an ExecuTorch program",
    "corrupt.pte": RUNTIME_REFUSED,
    "unknown-delegate.pte": r": method 'forward' could not be loaded by the ExecuTorch runtime \(RuntimeError: .*\); its delegates must be among this runtime's backends \[.*'XnnpackBackend'.*\]",
}
ADAPTER = r"expected an etblocks adapter file \(\.ptd with lora_A/lora_B tensors\)"
ADAPTER_CASES = {
    "random.ptd": r"is not an ExecuTorch file \(bytes 4-8 are .*, not the identifier b'FT01'\); " + ADAPTER,
    "truncated.ptd": r"is truncated: its header declares \d+ bytes, the file holds \d+; " + ADAPTER,
    "empty.ptd": "is empty; " + ADAPTER,
    "directory.ptd": "is a directory; " + ADAPTER,
    "program": r"is an ExecuTorch program \(\.pte\); " + ADAPTER,
    "weights.ptd": r"is not an etblocks adapter file \(\.ptd with lora_A/lora_B tensors\): unexpected tensor 'embedding\.weight'",
}
DATA_CASES = {
    "random.ptd": r"is not an ExecuTorch file .*; expected an ExecuTorch data file \(\.ptd, FlatTensor\)",
    "program": r"is an ExecuTorch program \(\.pte\); expected an ExecuTorch data file",
    "empty.ptd": "is empty; expected an ExecuTorch data file",
    "directory.ptd": "is a directory; expected an ExecuTorch data file",
}


def file_of(name: str, files) -> Path:
    program, adapter, bad = files
    return {"program": program, "adapter": adapter}.get(name, bad / name)


@pytest.mark.slow
def test_runner_refuses_every_bad_file_with_an_etblocks_error(files):
    """In one subprocess (an abort would end it with a signal): each bad file gives an `EtblocksError` naming the
    file and what was expected, through `Runner(path)`, `Runner(..., data_path=)`, `Runner(..., adapters=)` and
    `add_adapter`; the sound program with its adapter loads."""
    program, adapter, _ = files
    cases = [("sound", "adapters", str(adapter))]
    cases += [(f"program {name}", "program", str(file_of(name, files))) for name in PROGRAM_CASES]
    cases += [(f"data_path {name}", "data_path", str(file_of(name, files))) for name in DATA_CASES]
    cases += [(f"adapters {name}", "adapters", str(file_of(name, files))) for name in ADAPTER_CASES]
    cases += [(f"add_adapter {name}", "add_adapter", str(file_of(name, files))) for name in ("random.ptd", "program")]
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER_CASES, str(program), json.dumps(cases)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # not negative: no signal; not 1: no other exception
    outcomes = {label: (kind, message) for label, kind, message in map(json.loads, proc.stdout.splitlines())}
    assert list(outcomes) == [label for label, _, _ in cases]
    assert outcomes.pop("sound") == ("loaded", "")
    expected = {f"program {n}": p for n, p in PROGRAM_CASES.items()}
    expected |= {f"data_path {n}": p for n, p in DATA_CASES.items()}
    expected |= {f"adapters {n}": p for n, p in ADAPTER_CASES.items()}
    expected |= {f"add_adapter {n}": ADAPTER_CASES[n] for n in ("random.ptd", "program")}
    for (label, _, path), (kind, message) in zip(cases[1:], outcomes.values()):
        error = AdapterMismatchError if label.endswith("weights.ptd") else ProgramFileError
        assert kind == error.__name__ and issubclass(error, EtblocksError), (label, kind, message)
        assert message.startswith(path) and re.search(expected[label], message), (label, message)


def etblocks_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("etblocks") or str(Path(sys.executable).with_name("etblocks"))
    return subprocess.run([exe, "run", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_etblocks_run_exits_2_with_one_error_line_for_every_bad_file(files):
    """Each bad .pte, and a program given as the adapter of the sound one: exit code 2 (never a signal) and one
    `error: <file> ...` line on stderr."""
    program, _, bad = files
    cases = [(["--pte", str(file_of(name, files))], name, PROGRAM_CASES[name]) for name in
             ("random.pte", "truncated.pte", "empty.pte", "directory.pte", "adapter")]
    cases.append((["--pte", str(program), "--adapter", f"A={program}"], "program", ADAPTER_CASES["program"]))
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda case: etblocks_run([*case[0], "--prompt-ids", "1,2"], bad), cases))
    for (args, name, problem), proc in zip(cases, procs):
        assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
        lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(lines) == 1, (args, proc.stderr)
        assert lines[0].startswith(f"error: {file_of(name, files)}") and re.search(problem, lines[0]), (args, lines[0])
        assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr


EXPORT_UNDER_LIMIT = """
import resource, signal, sys
import etblocks
from etblocks.demo import demo_model

out, limit = sys.argv[1], int(sys.argv[2])
model = etblocks.swap(demo_model(seed=0), backend="xnnpack", max_seq_len=32)
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # killed at the first write past the limit (Python ignores it)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
etblocks.export(model, backend="xnnpack", out=out)
"""


@pytest.mark.slow
def test_export_killed_while_writing_leaves_the_previous_program(files, tmp_path):
    """The export process is killed (SIGXFSZ, at a file size limit of half the program) while it writes the
    program: the file under the final name is the previous one, byte for byte; the part written is in a hidden
    file beside it."""
    program, _, _ = files
    out = tmp_path / "demo.pte"
    previous = program.read_bytes()[:5000]
    out.write_bytes(previous)
    limit = program.stat().st_size // 2
    proc = subprocess.run([sys.executable, "-c", EXPORT_UNDER_LIMIT, str(out), str(limit)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr[-3000:]
    assert out.read_bytes() == previous
    partial = [p for p in tmp_path.iterdir() if p != out]
    assert [p.name.startswith(".demo.pte.") and p.stat().st_size == limit for p in partial] == [True]
