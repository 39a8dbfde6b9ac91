"""Running the Triton kernels on CPU tensors through Triton's interpreter (tests, benchmark smoke mode)."""

import os
import sys

index_fixed = False  # Triton's interpreter has this process's numpy >= 2.4 fix


def enable(*, route_ops: bool = True) -> None:
    """Switch Triton to its interpreter for this process, whatever was imported before, and (route_ops)
    send every `kernels.<op>` called with CPU tensors to its Triton launcher, so a whole engine runs its
    GPU path on CPU (kernels.route_cpu_to_triton; `disable_routing()` goes back to the references).

    - sets TRITON_INTERPRET=1, so kernels decorated from now on are interpreted;
    - converts already-decorated kernels (Triton's own standard library, e.g. tl.zeros and the
      reductions, and this package's kernels) into interpreted functions: Triton decides at
      decoration time, and other libraries (peft, for one) import triton early;
    - makes the interpreter work with numpy >= 2.4: Triton 3.6 converts scalars held as
      one-element arrays with int(array), which numpy 2.4 rejects, so every loop with runtime
      bounds fails (triton-lang/triton#9171, fixed upstream the same way, by squeezing first).
    """
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    global index_fixed
    if not index_fixed:
        original = interpreter._patch_lang_tensor

        def patch_lang_tensor(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

        interpreter._patch_lang_tensor = patch_lang_tensor
        index_fixed = True

    converted: dict[int, interpreter.InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("triton.language") or name.split(".")[0] == "kernels"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in converted:
                    converted[id(value)] = interpreter.InterpretedFunction(value.fn)
                setattr(module, attr, converted[id(value)])
    if route_ops:
        import kernels

        kernels.route_cpu_to_triton(True)


def disable_routing() -> None:
    """CPU tensors go back to the references (the interpreter itself stays on)."""
    import kernels

    kernels.route_cpu_to_triton(False)
