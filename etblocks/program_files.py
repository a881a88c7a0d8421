"""ExecuTorch program (.pte) and data (.ptd) files: checked before the runtime loads them, written whole.

The runtime is not a safe judge of a file: given foreign bytes, it logs the bytes where its file identifier
should be, and its Python bindings abort the whole process on a log line that is not UTF-8. So the head of every
file is read here first, and a file is handed on only if it is the kind expected and as long as its header says;
the messages also say what is wrong, where the runtime gives an error code.
workaround(executorch 1.5.1): the bindings send C++ log lines to `sys.stderr` through pybind11's stream redirect,
which raises on invalid UTF-8 inside C++ (`terminate called after throwing an instance of
'pybind11::error_already_set'`, exit 134): `Runner("random.bin")` did this before these checks.

Layouts (little-endian; written by `executorch/exir/_serialize/_program.py`: `_ExtendedHeader`,
`_insert_flatbuffer_header`, and `executorch/extension/flat_tensor/serialize/serialize.py`: `FlatTensorHeader`;
read by `runtime/executor/program.cpp` and `extension/flat_tensor/serialize/flat_tensor_header.cpp`, which load
the first 64 bytes of a file):

    bytes 0-4   uint32 offset of the flatbuffer's root table
    bytes 4-8   file identifier: b"ET12" for a program (schema/program.fbs), b"FT01" for data (flat_tensor.fbs)
    .pte, from byte 8, when the program has segments:
                b"eh00", uint32 header length (>= 24), uint64 program size, uint64 segment base offset,
                uint64 segment data size (present when the length is more than 24)
    .ptd, from byte 8, always:
                b"FH01", uint32 header length (>= 40), uint64 flatbuffer offset, uint64 flatbuffer size,
                uint64 segment base offset, uint64 segment data size
"""

from __future__ import annotations

import os
import struct
import uuid
from pathlib import Path
from typing import Any

from etblocks.errors import ProgramFileError, exception_summary

PROGRAM_IDENTIFIER = b"ET12"
DATA_IDENTIFIER = b"FT01"
HEAD_BYTES = 64  # what both runtime readers load before anything else; a shorter file is no ExecuTorch file

PROGRAM = "an ExecuTorch program (.pte) such as etblocks.export writes"
DATA = "an ExecuTorch data file (.ptd, FlatTensor)"

_KINDS = {b"ET": "an ExecuTorch program (.pte)", b"FT": "an ExecuTorch data file (.ptd)"}  # by identifier prefix
_PROGRAM_HEADER = (b"eh00", 24)  # magic, shortest valid length
_DATA_HEADER = (b"FH01", 40)


def check_program_file(path: str | Path, expected: str = PROGRAM) -> Path:
    """`path` as a `Path` if it holds an ExecuTorch program of the version this runtime reads, at least as long as
    its extended header declares; `ProgramFileError` naming the file and `expected` otherwise."""
    path = Path(path)
    head, size = _read_head(path, expected)
    _check_identifier(path, head, PROGRAM_IDENTIFIER, expected)
    magic, length, *fields = struct.unpack_from("<4sIQQQ", head, 8)
    if magic != _PROGRAM_HEADER[0]:  # no segments: the whole file is the flatbuffer
        _check_size(path, size, struct.unpack_from("<I", head)[0] + 4, "its root table offset needs", expected)
        return path
    _check_header_length(path, length, _PROGRAM_HEADER[1], expected)
    program_size, segment_base, segment_size = fields if length > _PROGRAM_HEADER[1] else (*fields[:2], 0)
    _check_size(path, size, max(program_size, segment_base + segment_size), "its header declares", expected)
    return path


def is_program_file(path: str | Path) -> bool:
    """Whether `path` reads as an ExecuTorch program (of any format version), by its identifier: which check the
    file then takes. False for anything else, unreadable files included (their check says why)."""
    try:
        head, _ = _read_head(Path(path), PROGRAM)
    except ProgramFileError:
        return False
    return head[4:6] == PROGRAM_IDENTIFIER[:2]


def check_data_file(path: str | Path, expected: str = DATA) -> Path:
    """`path` as a `Path` if it holds an ExecuTorch data file (FlatTensor) at least as long as its header declares;
    `ProgramFileError` naming the file and `expected` otherwise."""
    path = Path(path)
    head, size = _read_head(path, expected)
    _check_identifier(path, head, DATA_IDENTIFIER, expected)
    magic, length, flatbuffer_offset, flatbuffer_size, segment_base, segment_size = struct.unpack_from("<4sIQQQQ", head, 8)
    if magic != _DATA_HEADER[0]:
        raise ProgramFileError(
            f"{path} has no FlatTensor header (bytes 8-12 are {magic!r}, not {_DATA_HEADER[0]!r}); expected {expected}"
        )
    _check_header_length(path, length, _DATA_HEADER[1], expected)
    declared = max(flatbuffer_offset + flatbuffer_size, segment_base + segment_size)
    _check_size(path, size, declared, "its header declares", expected)
    return path


def load_program(path: str | Path, data_path: str | Path | None = None) -> LoadedProgram:
    """The program at `path` (with the data file `data_path`) loaded by the ExecuTorch runtime, each file checked
    first; whatever the runtime still refuses (a corrupt flatbuffer behind a sound header) is a `ProgramFileError`
    too."""
    path = check_program_file(path)
    kwargs = {"data_path": str(check_data_file(data_path))} if data_path is not None else {}
    from executorch.runtime import Runtime  # after the checks: a refused file costs no import of exir

    try:
        return LoadedProgram(Runtime.get().load_program(str(path), **kwargs), path, kwargs.get("data_path"))
    except Exception as exc:  # RuntimeError with an error code; the runtime logs the reason above it
        raise ProgramFileError(f"{path} could not be loaded by the ExecuTorch runtime ({exception_summary(exc)}); expected {PROGRAM}") from None


class LoadedProgram:
    """The runtime's `executorch.runtime.Program` for a checked file. Loading a method is where a program meets
    its delegates, so `load_method` names the file, the method and the backends this runtime has when the runtime
    refuses (a program lowered for a backend built for another platform, such as vulkan or coreml here)."""

    def __init__(self, program: Any, path: Path, data_path: str | None = None) -> None:
        self.runtime_program = program
        self.path = path
        self.data_path = data_path

    @property
    def method_names(self) -> set[str]:
        return self.runtime_program.method_names

    def load_method(self, name: str) -> Any:
        from executorch.runtime import Runtime

        try:
            return self.runtime_program.load_method(name)
        except Exception as exc:  # RuntimeError with an error code, as above
            backends = sorted(Runtime.get().backend_registry.registered_backend_names)
            data = (
                f"the data file given ({self.data_path}) must be the one exported with it" if self.data_path else
                "a program whose weights were written apart needs their data file (.ptd), which was not given"
            )
            raise ProgramFileError(
                f"{self.path}: method {name!r} could not be loaded by the ExecuTorch runtime ({exception_summary(exc)}); "
                f"its delegates must be among this runtime's backends {backends}, and {data}"
            ) from None


def write_whole(path: str | Path, data: bytes | bytearray | memoryview) -> Path:
    """Write `data` to `path` through a new file beside it, renamed over `path` once written and synced: an
    interruption (a crash, Ctrl-C, a full disk) leaves the previous file or none under `path`, never part of one.
    Creates the directory; returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the usual mode, umask applied
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())  # the rename must not reach the disk before the bytes do
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _read_head(path: Path, expected: str) -> tuple[bytes, int]:
    """The first `HEAD_BYTES` of `path` and its size; `ProgramFileError` for anything that is no such file."""
    if path.is_dir():
        raise ProgramFileError(f"{path} is a directory; expected {expected}")
    if not path.exists():
        raise ProgramFileError(f"{path} does not exist; expected {expected}")
    if not path.is_file():  # a device or a pipe: reading it could block or never end
        raise ProgramFileError(f"{path} is not a regular file; expected {expected}")
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            head = file.read(HEAD_BYTES)
    except OSError as exc:
        raise ProgramFileError(f"{path} could not be read ({exc.strerror or exc}); expected {expected}") from None
    if size == 0:
        raise ProgramFileError(f"{path} is empty; expected {expected}")
    if len(head) < HEAD_BYTES:
        raise ProgramFileError(
            f"{path} holds {size} bytes, fewer than the {HEAD_BYTES} of an ExecuTorch file's head; expected {expected}"
        )
    return head, size


def _check_identifier(path: Path, head: bytes, wanted: bytes, expected: str) -> None:
    found = head[4:8]
    if found == wanted:
        return
    if found[:2] == wanted[:2]:
        raise ProgramFileError(
            f"{path} is from another ExecuTorch format version (file identifier {found!r}; this runtime reads "
            f"{wanted!r}); export it again with the installed ExecuTorch; expected {expected}"
        )
    if found[:2] in _KINDS:
        raise ProgramFileError(f"{path} is {_KINDS[found[:2]]}; expected {expected}")
    raise ProgramFileError(
        f"{path} is not an ExecuTorch file (bytes 4-8 are {found!r}, not the identifier {wanted!r}); expected {expected}"
    )


def _check_header_length(path: Path, length: int, shortest: int, expected: str) -> None:
    if length < shortest:
        raise ProgramFileError(
            f"{path} has a corrupt header (its length field says {length} bytes, at least {shortest} are needed); "
            f"expected {expected}"
        )


def _check_size(path: Path, size: int, declared: int, what: str, expected: str) -> None:
    if size < declared:
        raise ProgramFileError(f"{path} is truncated: {what} {declared} bytes, the file holds {size}; expected {expected}")

