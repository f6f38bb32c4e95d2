"""abi.py's ctypes side of infer's C kernels agrees with their interface, ``csrc/cpu_kernels.h``: every struct it
mirrors field by field (names in order, offsets, sizes, as the C compiler lays them out), every function it binds
(declared, with the same return type and parameters), and the weight kinds."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest

from infer.kernels.cpu import abi, blocks, builder

HEADER = "cpu_kernels.h"
# The C struct (a typedef in the header) each ctypes Structure of abi.py mirrors.
MIRRORS = {
    "LayerStruct": "infer_layer",
    "DraftHeadStruct": "infer_draft_head",
    "AttentionStepStruct": "infer_attention_step",
}
# How a ctypes type reads in C, as the header's declarations are classified below.
CTYPES_IN_C = {ctypes.c_void_p: "pointer", ctypes.c_int64: "int64_t", ctypes.c_float: "float", None: "void"}


def header() -> str:
    """The header as the builder stages it, comments removed."""
    text = builder.sources()[HEADER]
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.DOTALL)


def c_kind(declaration: str) -> str:
    """A declaration's type, as CTYPES_IN_C names it: any pointer is "pointer", else its type name."""
    if "(" in declaration or "[" in declaration:
        raise AssertionError(f"the header check reads no function pointers or arrays: {declaration!r}")
    if "*" in declaration:
        return "pointer"
    words = [word for word in declaration.split() if word not in ("const", "volatile")]
    return " ".join(words[:-1]) if len(words) > 1 else words[0]


def c_structs() -> dict[str, list[tuple[str, str]]]:
    """Every ``typedef struct {...} name;`` of the header: its fields in order, (name, kind) each."""
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\{(.*?)\}\s*(\w+)\s*;", header(), flags=re.DOTALL):
        fields = []
        for declaration in filter(None, (part.strip() for part in body.split(";"))):
            first, *more = (part.strip() for part in declaration.split(","))
            base = re.sub(r"\**\s*\w+$", "", first).strip()  # the type the comma-separated declarators share
            for declarator in (first, *(f"{base} {part}" for part in more)):
                fields.append((re.findall(r"\w+", declarator)[-1], c_kind(declarator)))
        structs[name] = fields
    return structs


def c_functions() -> dict[str, tuple[str, list[str]]]:
    """Every function the header declares: its return kind and its parameters' kinds."""
    text = re.sub(r"typedef\s+struct\s*\{.*?\}\s*\w+\s*;", " ", header(), flags=re.DOTALL)
    functions = {}
    for returns, name, parameters in re.findall(r"([\w \t*]+?)\s*\b(\w+)\s*\(([^)]*)\)\s*;", text):
        kinds = [] if parameters.strip() in ("", "void") else [c_kind(p.strip()) for p in parameters.split(",")]
        functions[name] = ("pointer" if "*" in returns else returns.split()[-1], kinds)
    return functions


def mirrored_structures() -> dict[str, type[ctypes.Structure]]:
    return {
        name: value
        for name, value in vars(abi).items()
        if isinstance(value, type) and issubclass(value, ctypes.Structure) and value.__module__ == abi.__name__
    }


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    """offsetof and sizeof of every field of every struct in the header, its sizeof, and the KIND_* values, as the
    builder's compiler lays them out: ``"struct"``, ``"struct.field"`` (offset) and ``"struct.field:size"``."""
    cc = builder.compiler()
    if cc is None:
        pytest.skip(
            "no C compiler found (set $CC, or install gcc): the layout check compiles a program that "
            "includes the header"
        )
    folder = tmp_path_factory.mktemp("abi")
    (folder / HEADER).write_text(builder.sources()[HEADER])
    lines = []
    for struct, fields in c_structs().items():
        lines.append(f'printf("{struct} %zu\\n", sizeof({struct}));')
        for field, _ in fields:
            lines.append(f'printf("{struct}.{field} %zu\\n", offsetof({struct}, {field}));')
            lines.append(f'printf("{struct}.{field}:size %zu\\n", sizeof((({struct} *)0)->{field}));')
    for kind in ("KIND_F16", "KIND_I8", "KIND_BF16", *(f"KIND_{name.upper()}" for name in blocks.BLOCK_KINDS)):
        lines.append(f'printf("{kind} %d\\n", (int){kind});')
    program = folder / "layout.c"
    program.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "cpu_kernels.h"\n\nint main(void) {\n    '
        + "\n    ".join(lines)
        + "\n    return 0;\n}\n"
    )
    flags = [flag for flag in builder.FLAGS if flag not in ("-shared", "-fPIC")]
    compiled = subprocess.run([cc, *flags, "-o", str(folder / "layout"), str(program)], capture_output=True, text=True)
    assert compiled.returncode == 0, f"the header does not compile on its own:\n{compiled.stderr}"
    output = subprocess.run([str(folder / "layout")], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in (line.split() for line in output.splitlines())}


def test_every_structure_of_abi_mirrors_a_struct_of_the_header():
    structs = c_structs()
    assert set(mirrored_structures()) == set(MIRRORS), "a ctypes Structure of abi.py without its C struct in MIRRORS"
    assert set(MIRRORS.values()) == set(structs), f"the header's structs {sorted(structs)} are not all mirrored"


@pytest.mark.parametrize("structure", sorted(MIRRORS))
def test_structure_fields_match_the_c_struct(structure, c_layout):
    python, struct = getattr(abi, structure), MIRRORS[structure]
    c_fields = c_structs()[struct]
    python_fields = [(name, CTYPES_IN_C.get(kind, kind.__name__)) for name, kind in python._fields_]
    assert python_fields == c_fields, f"abi.{structure}'s fields differ from {struct}'s in {HEADER}"
    for name, _ in c_fields:
        field = getattr(python, name)
        assert (field.offset, field.size) == (c_layout[f"{struct}.{name}"], c_layout[f"{struct}.{name}:size"]), (
            f"{struct}.{name}: ctypes at {field.offset} ({field.size} bytes), C at {c_layout[f'{struct}.{name}']}"
        )
    assert ctypes.sizeof(python) == c_layout[struct]


def test_weight_kinds_match_the_header(c_layout):
    assert abi.WEIGHT_KINDS == {
        kind: c_layout[f"KIND_{name}"] for kind, name in zip(abi.WEIGHT_KINDS, ("F16", "I8", "BF16"))
    }
    assert [c_layout[f"KIND_{name}"] for name in ("F16", "I8", "BF16")] == [0, 1, 2]
    assert blocks.BLOCK_KINDS == {name: c_layout[f"KIND_{name.upper()}"] for name in blocks.BLOCK_KINDS}


class _Function:
    """What abi.py sets on and calls of a C function, recorded instead."""

    argtypes = None
    restype: object = "unset"

    def __call__(self, *args):
        return 0  # every query's "none" (portable SIMD, no tiles, no flash attention)


class _Library:
    """A stand-in for the loaded library: the functions abi.py asks it for, by name."""

    def __init__(self):
        self.functions: dict[str, _Function] = {}

    def __getattr__(self, name: str) -> _Function:
        return self.functions.setdefault(name, _Function())


def test_every_function_abi_binds_is_declared_alike():
    library = _Library()
    abi.CpuKernels(library, None)
    declared = c_functions()
    assert library.functions, "abi.CpuKernels bound no function"
    for name, function in library.functions.items():
        assert name in declared, f"abi.py binds {name}, which {HEADER} does not declare"
        assert function.restype != "unset" and function.argtypes is not None, f"abi.py leaves {name}'s types unset"
        returns, parameters = declared[name]
        bound = (CTYPES_IN_C[function.restype], [CTYPES_IN_C[kind] for kind in function.argtypes])
        assert bound == (returns, parameters), (
            f"{name}: abi.py binds {bound}, {HEADER} declares {(returns, parameters)}"
        )


def test_the_library_exports_exactly_what_the_header_declares():
    if builder.compiler() is None:
        pytest.skip("no C compiler found (set $CC, or install gcc) to build the kernels")
    from infer.kernels import cpu as cpu_kernels

    kernels = cpu_kernels.load(True)
    declared = set(c_functions())
    library = ctypes.CDLL(str(kernels.path))
    missing = [name for name in sorted(declared) if not hasattr(library, name)]
    assert not missing, f"declared in {HEADER} but not in the library: {missing}"
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols (the helpers shared between files should stay hidden)")
    listing = subprocess.run(
        [nm, "-D", "--defined-only", str(kernels.path)], capture_output=True, text=True, check=True
    ).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.split()[-2:-1] == ["T"]}
    assert exported == declared, f"exported but not declared: {sorted(exported - declared)}"
