"""Running the Triton kernels on CPU tensors through Triton's interpreter (tests, benchmark smoke mode).

Kernels are built as interpreted functions only if TRITON_INTERPRET is set when they are
decorated, so call `enable()` before importing (or reload) the kernel modules.
"""

import os


def enable() -> None:
    """Set TRITON_INTERPRET=1 and make the interpreter work with numpy >= 2.4.

    Triton 3.6's interpreter converts scalars held as one-element arrays with int(array), which
    numpy 2.4 rejects, so every loop with runtime bounds fails (triton-lang/triton#9171, fixed
    upstream by squeezing first). The same fix is applied here, to the interpreter only.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime import interpreter

    if getattr(interpreter, "_quilt_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    interpreter._quilt_index_fix = True
