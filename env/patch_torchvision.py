"""Make the only torchvision wheel on PyPI (CUDA-built) importable with the CPU torch.

SGLang imports torchvision for multimodal processors. The wheel's `_C.so` links CUDA libraries,
and `_meta_registrations.py` registers fake kernels for `torchvision::nms`/`qnms` unconditionally,
which fails once `_C.so` is gone. We delete the library and guard those two registrations.
Idempotent.
"""
import importlib.util
import pathlib
import re

spec = importlib.util.find_spec("torchvision")
if spec is None or spec.submodule_search_locations is None:
    raise SystemExit("patch_torchvision: torchvision is not installed")
root = pathlib.Path(list(spec.submodule_search_locations)[0])
for lib in root.glob("_C*.so"):
    lib.unlink()
meta = root / "_meta_registrations.py"
text = meta.read_text()
pattern = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)', re.M)
patched = pattern.sub(
    r'@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))',
    text,
)
if patched != text:
    meta.write_text(patched)
