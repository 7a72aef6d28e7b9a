"""The ground truth for the fake torch_npu: files of the published torch_npu wheels, fetched once and cached.

`import torch_npu` needs CANN, but the wheel's plain files carry the API: the op schemas (argument names, types,
defaults, return tuple) in npu_native_functions_by_codegen.yaml, the shape/dtype rules in the meta registrations,
the Python of torch_npu.npu / .profiler / .optim, the package's import sequence and entry points, and the messages
of its compiled library. Each wheel of TORCH_NPU_VERSIONS is downloaded from the package index with pip on first
use and only the files listed in WHEEL_FILES / DIST_INFO_FILES (and the library's message strings) are kept, under
$TITAN_CACHE_DIR (default ~/.cache/titan-npu)/torch_npu-<version>.

The fake runs on one wheel, `PINNED` (the one built for the installed torch: torch_npu X.Y.Z pins torch X.Y.Z, its
METADATA's Requires-Dist), and this module's functions (read, op_schema, define_ops, ...) are that wheel's; the
contract tests hold the fake and the project to every wheel of WHEELS.
"""

from __future__ import annotations

import ast
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types
import zipfile
from functools import cache
from importlib import metadata
from pathlib import Path

# The published wheels the fake and the project are held to, oldest first (titan_npu.device.npu.TESTED_TORCH_NPU).
TORCH_NPU_VERSIONS = ("2.13.0", "2.14.0")
WHEEL_PLATFORM = ("manylinux_2_28_x86_64", "3.11")  # any platform's wheel carries the same Python and yaml files
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
META_FILE = "torch_npu/op_plugin/meta/_meta_registrations.py"
WHEEL_FILES = (
    SCHEMA_FILE,
    META_FILE,
    "torch_npu/version.py",
    "torch_npu/__init__.py",
    "torch_npu/_init/core/optional_features.py",
    "torch_npu/npu/__init__.py",
    "torch_npu/npu/utils.py",
    "torch_npu/profiler/__init__.py",
    "torch_npu/profiler/profiler.py",
    "torch_npu/profiler/scheduler.py",
    "torch_npu/profiler/experimental_config.py",
    "torch_npu/optim/__init__.py",
    "torch_npu/optim/npu_fused_optim_base.py",
    "torch_npu/optim/npu_fused_adamw.py",
    "torch_npu/utils/combine_tensors.py",
    "torch_npu/include/torch_npu/csrc/distributed/ProcessGroupHCCL.hpp",
    "torch_npu/_op_plugin_docs.py",  # the API reference the fake's documented rules cite
    "torch_npu/distributed/tensor/_math_ops.py",  # DTensor sharding rules of the kernels
    "torch_npu/distributed/tensor/_matrix_ops.py",
    "torch_npu/distributed/tensor/_moe_ops.py",
    "torch_npu/distributed/tensor/_attention.py",
)
# Files of the wheel's torch_npu-<version>.dist-info, kept as dist-info/<name>: the README with the CANN pairing
# (METADATA) and the entry points (torch imports torch_npu through its torch.backends entry).
DIST_INFO_FILES = ("METADATA", "entry_points.txt")
METADATA_FILE = "dist-info/METADATA"
ENTRY_POINTS_FILE = "dist-info/entry_points.txt"
# The compiled library: only its printable strings about timeouts and HCCL are kept (the runtime's own messages).
LIBRARY = "torch_npu/lib/libtorch_npu.so"
LIBRARY_STRINGS_FILE = LIBRARY + ".strings"
_LIBRARY_STRING = re.compile(rb"[\x20-\x7e]{8,}")
_KEPT_STRING = re.compile(r"timeout|plog|HCCL_", re.IGNORECASE)


def cache_root(version: str) -> Path:
    """Where the extracted files of wheel `version` live (outside the repository)."""
    root = os.environ.get("TITAN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "titan-npu")
    return Path(root) / f"torch_npu-{version}"


def _download_and_extract(version: str, root: Path) -> None:
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--platform", WHEEL_PLATFORM[0], "--python-version", WHEEL_PLATFORM[1],
               f"torch-npu=={version}", "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("torch_npu-*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download torch-npu=={version} ({' '.join(cmd)}): "
                               f"{result.stderr.strip()[-2000:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = {name: name for name in WHEEL_FILES}
            members.update({f"torch_npu-{version}.dist-info/{name}": f"dist-info/{name}" for name in DIST_INFO_FILES})
            for member, relative in members.items():
                target = root / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                with wheel.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            strings = (s.decode() for s in _LIBRARY_STRING.findall(wheel.read(LIBRARY)))
            (root / LIBRARY_STRINGS_FILE).parent.mkdir(parents=True, exist_ok=True)
            (root / LIBRARY_STRINGS_FILE).write_text("\n".join(s for s in strings if _KEPT_STRING.search(s)) + "\n")


_FUNC = re.compile(r"^\s*(?:- )?func:\s*(.+?)\s*$")
_SECTION = re.compile(r"^([a-z_]+):\s*$")


class Wheel:
    """The kept files of one published torch_npu wheel and what the tests read from them."""

    METADATA_FILE, ENTRY_POINTS_FILE = METADATA_FILE, ENTRY_POINTS_FILE

    def __init__(self, version: str) -> None:
        self.version = version

    def __repr__(self) -> str:
        return f"Wheel({self.version!r})"

    def dir(self) -> Path:
        """The extracted files, downloading the wheel first when the cache does not hold them."""
        root = cache_root(self.version)
        done = root / ".complete"
        # a longer file list fetches again
        marker = "\n".join((self.version, *WHEEL_FILES, *DIST_INFO_FILES, LIBRARY_STRINGS_FILE)) + "\n"
        if done.exists() and done.read_text() == marker:
            return root
        root.mkdir(parents=True, exist_ok=True)
        with open(root / ".lock", "w") as lock:  # concurrent test processes download once
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists() or done.read_text() != marker:
                _download_and_extract(self.version, root)
                done.write_text(marker)
        return root

    def read(self, relative: str) -> str:
        """The text of one extracted wheel file."""
        return (self.dir() / relative).read_text()

    def lines(self, relative: str, pattern: str) -> list[tuple[int, str]]:
        """(line number, line) of a wheel file's lines that match regular expression `pattern`."""
        found = re.compile(pattern)
        return [(n, line) for n, line in enumerate(self.read(relative).splitlines(), 1) if found.search(line)]

    @cache  # noqa: B019  (two wheels, kept for the process)
    def schemas(self) -> dict[str, dict[str, str]]:
        """{section: {"name[.overload]": schema}} for every op of the yaml ("custom", "supported", "autograd", ...)."""
        out: dict[str, dict[str, str]] = {}
        section = ""
        for line in self.read(SCHEMA_FILE).splitlines():
            m = _SECTION.match(line)
            if m:
                section = m.group(1)
                continue
            m = _FUNC.match(line)
            if m:
                schema = m.group(1)
                out.setdefault(section, {}).setdefault(schema.split("(", 1)[0], schema)
        return out

    def op_schema(self, name: str) -> str:
        """The schema of torch_npu op `name` (a torch_npu.<name> function, i.e. torch.ops.npu.<name>)."""
        for section in ("custom", "autograd", "quant", "symint"):
            schema = self.schemas().get(section, {}).get(name)
            if schema is not None:
                return schema
        raise KeyError(f"torch_npu {self.version} defines no op {name!r}")

    def aten_schema(self, name: str) -> str:
        """The schema of aten op `name` ("_fused_adamw_") as the wheel's NPU kernels implement it."""
        return self.schemas()["supported"][name]

    def op_names(self) -> set[str]:
        """Base names of every op the wheel defines (torch_npu.<name> for the custom ones)."""
        return {key.split(".", 1)[0] for section in self.schemas().values() for key in section}

    @cache  # noqa: B019
    def module_names(self, module: str) -> frozenset[str]:
        """Names bound at the top level of wheel module `module` ("torch_npu.npu"), read from its __init__.py."""
        relative = module.replace(".", "/") + "/__init__.py"
        tree = ast.parse(self.read(relative))
        names: set[str] = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    names.update(ast.literal_eval(node.value))
        return frozenset(names)

    def parameters(self, relative: str, qualname: str) -> list[tuple[str, str]]:
        """(name, kind) of the parameters of function or class `qualname` ("profile", "Schedule") in a wheel file,
        read with ast; a class gives its __init__'s (without self). kind: positional / keyword_only / var."""
        tree = ast.parse(self.read(relative))
        node = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == qualname)
        if isinstance(node, ast.ClassDef):
            node = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        a = node.args
        out = [(x.arg, "positional") for x in (*a.posonlyargs, *a.args) if x.arg != "self"]
        out += [(x.arg, "keyword_only") for x in a.kwonlyargs]
        out += [(x.arg, "var") for x in (a.vararg, a.kwarg) if x is not None]
        return out

    def class_attributes(self, relative: str, name: str) -> set[str]:
        """Names assigned in the body of class `name` of a wheel file."""
        tree = ast.parse(self.read(relative))
        node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
        return {t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}

    def torch_requirement(self) -> str:
        """The torch release the wheel requires ("2.14.0" from its METADATA's `Requires-Dist: torch==2.14.0.*`)."""
        m = re.search(r"^Requires-Dist: torch==(\d+\.\d+\.\d+)\.\*\s*$", self.read(METADATA_FILE), re.MULTILINE)
        if m is None:
            raise ValueError(f"torch_npu {self.version}: no `Requires-Dist: torch==X.Y.Z.*` in its METADATA")
        return m.group(1)

    def write_dist_info(self, site: Path) -> Path:
        """Install the wheel's dist-info (METADATA, entry_points.txt) into directory `site`: with `site` and the fake
        on the path, the fake is the installed torch_npu of this version, which `import torch` imports through the
        wheel's torch.backends entry point. FAKE_TORCH_NPU_VERSION, which the fake reports as its __version__, is
        the installed version too."""
        target = Path(site) / f"torch_npu-{self.version}.dist-info"
        target.mkdir(parents=True, exist_ok=True)
        for name in DIST_INFO_FILES:
            (target / name).write_text(self.read(f"dist-info/{name}"))
        version = os.environ.get("FAKE_TORCH_NPU_VERSION")
        if version:
            metadata_file = target / "METADATA"
            metadata_file.write_text(re.sub(r"^Version: .*$", f"Version: {version}", metadata_file.read_text(),
                                            count=1, flags=re.MULTILINE))
        return target

    def library_strings(self) -> str:
        """The compiled library's printable strings about timeouts and HCCL, one a line (its own messages)."""
        return self.read(LIBRARY_STRINGS_FILE)

    @cache  # noqa: B019
    def meta_functions(self) -> dict[str, types.FunctionType]:
        """The wheel's Meta implementations of torch.ops.npu ops, by op name, for checking output shapes and dtypes.

        The file registers them with torch.library at import; here it runs with `impl` replaced by a collector and
        the few torch_npu helpers it imports replaced by stand-ins (an A2-class chip, a current CANN).
        """
        import torch.library

        collected: dict[str, types.FunctionType] = {}

        class _Collector:
            def __init__(self, *args, **kwargs) -> None:
                pass

        def _impl(_lib, name, *args, **kwargs):
            def register(fn):
                collected[name] = fn
                return fn
            return register

        shims = {
            "torch_npu": types.ModuleType("torch_npu"),
            "torch_npu.utils": types.ModuleType("torch_npu.utils"),
            "torch_npu.utils._error_code": error_code_module(),
            "torch_npu.npu": types.ModuleType("torch_npu.npu"),
            "torch_npu.npu.utils": types.ModuleType("torch_npu.npu.utils"),
            "torch_npu.npu._backends": types.ModuleType("torch_npu.npu._backends"),
        }
        # torch_npu's own dtypes (hifloat8, float4_e2m1fn_x2, ...) that rules compare arguments with: stand-ins equal
        # to no torch dtype.
        for dtype in ("hifloat8", "float4_e2m1fn_x2", "float4_e1m2fn_x2", "float8_e8m0fnu"):
            setattr(shims["torch_npu"], dtype, f"torch_npu.{dtype}")
        shims["torch_npu.npu.utils"].get_cann_version = lambda: "8.5.0"
        shims["torch_npu.npu._backends"].get_soc_version = lambda: 220  # Ascend910B3
        saved_modules = {name: sys.modules.get(name) for name in shims}
        saved = torch.library.Library, torch.library.impl
        sys.modules.update(shims)
        torch.library.Library, torch.library.impl = _Collector, _impl
        # Top-level has_side_effect(torch.ops.npu.<op>.default) lines name ops this process does not define.
        source = re.sub(r"^has_side_effect\(.*$", "", self.read(META_FILE), flags=re.MULTILINE)
        try:
            namespace: dict = {"__name__": "torch_npu_meta_registrations"}
            exec(compile(source, str(self.dir() / META_FILE), "exec"), namespace)
        finally:
            torch.library.Library, torch.library.impl = saved
            for name, module in saved_modules.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
        return collected

    def check_against_meta(self, name: str, args: tuple, kwargs: dict, out) -> None:
        """Raise if `out` differs in arity, shape or dtype from what the wheel's meta function of `name` gives."""
        import torch
        from torch.utils._pytree import tree_map

        meta = self.meta_functions().get(name)
        if meta is None:
            return

        def to_meta(x):
            if isinstance(x, torch.Tensor):
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            return x

        with torch.no_grad():
            expected = meta(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        got_items = out if isinstance(out, (tuple, list)) else (out,)
        want_items = expected if isinstance(expected, (tuple, list)) else (expected,)
        if len(got_items) != len(want_items):
            raise RuntimeError(f"{name}: {len(got_items)} outputs, the wheel's meta function gives {len(want_items)}")
        for i, (got, want) in enumerate(zip(got_items, want_items)):
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                    shape = (tuple(got.shape), got.dtype) if isinstance(got, torch.Tensor) else type(got).__name__
                    raise RuntimeError(f"{name}: output {i} is {shape}, the wheel's meta function gives "
                                       f"{(tuple(want.shape), want.dtype)}")


def _release(version: str) -> str:
    m = re.match(r"\d+\.\d+\.\d+", version)
    return m.group(0) if m else ""


def pinned_version() -> str:
    """The wheel the fake runs on: the one built for the installed torch (torch_npu X.Y.Z needs torch X.Y.Z), else
    the newest. Read from torch's package metadata, without importing torch."""
    try:
        torch_release = _release(metadata.version("torch"))
    except metadata.PackageNotFoundError:
        torch_release = ""
    return next((v for v in TORCH_NPU_VERSIONS if _release(v) == torch_release), TORCH_NPU_VERSIONS[-1])


WHEELS = {version: Wheel(version) for version in TORCH_NPU_VERSIONS}
TORCH_NPU_VERSION = pinned_version()
PINNED = WHEELS[TORCH_NPU_VERSION]
# The pinned wheel's files, as the fake reads them.
wheel_dir, read, schemas, op_schema, aten_schema, op_names = (
    PINNED.dir, PINNED.read, PINNED.schemas, PINNED.op_schema, PINNED.aten_schema, PINNED.op_names)
module_names, parameters, class_attributes, meta_functions, check_against_meta = (
    PINNED.module_names, PINNED.parameters, PINNED.class_attributes, PINNED.meta_functions, PINNED.check_against_meta)


def error_code_module() -> types.ModuleType:
    """A stand-in for torch_npu.utils._error_code (error-message suffixes)."""
    module = types.ModuleType("torch_npu.utils._error_code")

    codes = type("ErrCodes", (), {n: n for n in ("VALUE", "TYPE", "PARAM", "NOT_SUPPORT", "INTERNAL", "UNAVAIL",
                                                 "NOT_FOUND", "PTR", "SYSCALL", "TIMEOUT", "PERMISSION", "ACL")})
    module.ErrCode = codes
    module.ops_error = lambda code, *args, **kwargs: f" [{code}]"
    module.pta_error = lambda code, *args, **kwargs: f" [{code}]"
    module.dist_error = lambda code, *args, **kwargs: f" [{code}]"
    return module


def load_module(relative: str, name: str, extra_globals: dict | None = None) -> types.ModuleType:
    """Execute one wheel Python file as module `name` (its imports must resolve, e.g. to the fake torch_npu)."""
    module = types.ModuleType(name)
    module.__file__ = str(wheel_dir() / relative)
    module.__package__ = name.rpartition(".")[0]
    module.__dict__.update(extra_globals or {})
    sys.modules[name] = module
    exec(compile(read(relative), module.__file__, "exec"), module.__dict__)
    return module


# --- the ops, defined on CPU with the wheel's schemas --------------------------------------------------------------

_library = None  # torch.library.Library("npu", "FRAGMENT"), made once per process (definitions cannot be undone)
_defined: set[str] = set()
_implemented: set[str] = set()
_kernels: dict[str, types.FunctionType] = {}  # the newest implementation of each op (the fake may be re-imported)


def define_ops(names: list[str], kernels: dict, without_autograd: tuple[str, ...] = ()) -> None:
    """torch.ops.npu.<name> for every name, with the pinned wheel's schema; those in `kernels` get a CPU kernel.

    The kernel is registered as CompositeImplicitAutograd, so autograd runs through its plain-torch body; the
    dispatcher parses every call against the wheel's schema (argument names, types, defaults) and the result is
    checked against the wheel's meta function (arity, shapes, dtypes). An op in `without_autograd` (one torch_npu
    registers no backward for) runs its body without recording a graph, as a compiled kernel does: a backward
    through it meets torch's autograd fallback (a warning and no gradient), as on a card.
    """
    import torch

    global _library
    if _library is None:
        _library = torch.library.Library("npu", "FRAGMENT")
    for name in names:
        if name not in _defined:
            _library.define(op_schema(name))
            _defined.add(name)
    _kernels.update(kernels)
    for name in kernels:
        if name not in _implemented:
            if name in without_autograd:
                _library.impl(name, _checked(name, record_graph=False), "CompositeExplicitAutograd")
            else:
                _library.impl(name, _checked(name), "CompositeImplicitAutograd")
            _implemented.add(name)


def _checked(name: str, record_graph: bool = True):
    import torch

    def kernel(*args, **kwargs):
        # A kernel computes in its own precision: autocast (on the CPU that stands in for the card) stays outside it.
        with torch.set_grad_enabled(torch.is_grad_enabled() and record_graph), torch.autocast("cpu", enabled=False):
            out = _kernels[name](*args, **kwargs)
        check_against_meta(name, args, kwargs, out)
        return out
    return kernel
