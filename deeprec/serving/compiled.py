"""The export's compiled serving program: an AOTInductor package of program.pt2.

    program.pt2 ──aoti_compile_and_package (at export)──> program.cpu.pt2   one C++ .so: the graph's
                                                                            kernels, fused; the deeprec
                                                                            ops called as their registered
                                                                            C++ kernels (no Python)
    serving: CompiledProgram(package, module)  the .so's constants re-bound to the ExportedProgram
             module's own tensors (not copied: `user_managed`), so the weights in memory are those of
             tables.safetensors, once, and an online update that keeps every shape re-binds a fresh
             runner to the new tensors. The package keeps its own copy of the weights: constants that
             inductor makes itself (a folded `torch.tensor` literal) exist nowhere else.

A package is specific to the torch version and CPU it was compiled for: a load that fails falls back
to the ExportedProgram (the caller warns, naming the reason). Shapes of constants are fixed at compile
time, which is why a frozen EmbeddingVariable keeps headroom (serving.frozen): deltas that add keys
fit in it; one that outgrows it sends scoring back to the ExportedProgram until the next full export.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch.utils import _pytree as pytree


def compile_options() -> dict:
    """Inductor's options for a package: every weight stays a constant the runner reads (inductor
    inlines 1-element ones otherwise), as online updates re-bind them all; serving's own graph passes
    after inductor's (serving.compile_passes: imported here, as inductor is, not by training)."""
    from deeprec.serving.compile_passes import ServingPasses

    return {"always_keep_tensor_constants": True, "post_grad_custom_post_pass": ServingPasses()}


def cpu_flags() -> list[str]:
    """This CPU's instruction-set flags (/proc/cpuinfo): inductor compiles with -march=native, so a
    package may use any of them (AVX-512 VNNI, BF16...), more than torch's capability name tells."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(set(line.partition(":")[2].split()))
    except OSError:
        pass
    return []


def package_name(device: str) -> str:
    return f"program.{device}.pt2"


def compile_package(program: torch.export.ExportedProgram, path: str, device: str,
                    held: contextlib.ExitStack) -> str | None:
    """Compile `program` (an ExportedProgram on `device`) into an AOTInductor package at `path`, or
    copy the package of the same program from the cache (serving.compile_cache). The cache key when
    it was compiled here (the caller stores it once the package passed its check), None if copied.
    The key's lock is entered into `held`: the caller keeps it until the package is stored."""
    from deeprec.serving import compile_cache

    options = compile_options()
    key = compile_cache.program_key(program, device, options, cpu_flags())
    held.enter_context(compile_cache.claimed(key))
    if compile_cache.fetch(key, path):
        return None
    # a dict of its own: inductor adds its entries to the one it is given
    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=options)
    return key


def constant_tensor(module: torch.nn.Module, fqn: str) -> torch.Tensor:
    """The tensor `fqn` (a.b.c) names in `module`: a parameter, a buffer or a lifted constant."""
    owner, _, name = fqn.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _leaves(value, out: list) -> None:
    """pytree's leaves of one column (a tensor, or a Ragged: its values' leaves, then its offsets),
    without pytree's per-node dispatch (at one row it cost a third of the compiled model's time)."""
    if isinstance(value, torch.Tensor):
        out.append(value)
    else:  # a Ragged (a NamedTuple: values, offsets)
        _leaves(value[0], out)
        out.append(value[1])


def _has(module: torch.nn.Module, fqn: str) -> bool:
    try:
        return isinstance(constant_tensor(module, fqn), torch.Tensor)
    except AttributeError:
        return False


class CompiledProgram:
    """A loaded package bound to `module`'s tensors: `program(batch)` is `module(batch)`, run in C++.
    Raises whatever the loader raises (another torch, another CPU, a missing constant): callers fall back."""

    def __init__(self, package: str, module: torch.nn.Module, device: str = "cpu"):
        runner = torch._inductor.aoti_load_package(package)
        self.package, self.loader, self.device = package, runner.loader, torch.device(device)
        self.fqns = [fqn for fqn in runner.get_constant_fqns() if _has(module, fqn)]  # the rest: the package's
        self.shapes = {fqn: tuple(constant_tensor(module, fqn).shape) for fqn in self.fqns}
        # weights the package does not read (inductor baked their values in): an update must leave them be
        self.baked = {name: t.detach().clone() for name, t in module.state_dict().items() if name not in self.shapes}
        self._bind(module)
        in_spec, out_spec = self.loader.get_call_spec()
        self.in_spec, self.out_spec = pytree.treespec_loads(in_spec), pytree.treespec_loads(out_spec)
        self.columns = list(self.in_spec.child(0).child(0).context)  # ((batch,), {}): its keys
        # outputs {name: tensor}: zipped with their names (pytree's unflatten cost ~25 us a call)
        flat_dict = self.out_spec.type is dict and all(c.is_leaf() for c in self.out_spec.children())
        self.outputs = list(self.out_spec.context) if flat_dict else None

    def _bind(self, module: torch.nn.Module) -> None:
        # on the CPU the module's own tensors (not copied); on a GPU their copies there
        self.tensors = {fqn: constant_tensor(module, fqn).detach().to(self.device) for fqn in self.fqns}
        self.loader.load_constants(self.tensors, False, False, True, False)  # active buffer, these, user-managed
        self.module = module  # keeps the bound tensors alive

    def fits(self, module: torch.nn.Module) -> str | None:
        """None if `module`'s constants have the compiled shapes, else the first that differs."""
        for fqn, shape in self.shapes.items():
            now = tuple(constant_tensor(module, fqn).shape)
            if now != shape:
                return f"{fqn} is now {list(now)}, the package was compiled for {list(shape)}"
        state = module.state_dict()
        for name, value in self.baked.items():
            if name in state and not torch.equal(state[name], value):
                return f"{name} changed, and the package holds its value compiled in"
        return None

    def rebound(self, module: torch.nn.Module) -> "CompiledProgram":
        """A fresh runner of the same package bound to `module` (an updated copy of the model): the
        runner serving now keeps its tensors until it is dropped, so no batch sees a half update."""
        if not os.path.exists(self.package):
            raise FileNotFoundError(f"{self.package}: the package is gone (a newer full export replaced it)")
        fresh = CompiledProgram(self.package, module, str(self.device))
        fresh.baked = self.baked  # the values compiled in, not the updated ones
        return fresh

    def __call__(self, batch: dict) -> dict:
        flat = []
        try:
            for name in self.columns:  # the traced column order; a Ragged's leaves are (values..., offsets)
                _leaves(batch[name], flat)
        except KeyError as err:
            raise ValueError(f"the batch lacks column {err.args[0]!r} of the compiled program") from None
        if len(flat) != self.in_spec.num_leaves or len(batch) != len(self.columns):  # the general check, named
            flat, spec = pytree.tree_flatten(((batch,), {}))
            raise ValueError(f"the batch's structure differs from the compiled program's: {spec} vs {self.in_spec}")
        if self.device.type != "cpu":
            flat = [t.to(self.device, non_blocking=True) for t in flat]
        out = self.loader.boxed_run(flat)
        return dict(zip(self.outputs, out)) if self.outputs is not None else pytree.tree_unflatten(out, self.out_spec)

