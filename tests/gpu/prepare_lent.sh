#!/usr/bin/env bash
# Prepare what tests/gpu/run_lent.sh carries to a bare CUDA machine without network:
#   .whl/            wheels for Python 3.12 x86-64 that its image lacks (sluice's own
#                    dependencies, FlashInfer repacked to fit a 64 MiB transfer, py-spy)
#   .gpu/tokenizer/  the embedded model's tokenizer files (the GGUF itself is ~100 MB)
# Run on a machine with pip and the embedded model prepared (`make install`).
set -eu
PY=${PY:-.venv/bin/python}
FI=flashinfer-python==0.7.2.post1
mkdir -p .whl .gpu/tokenizer /tmp/sluice-wheels
plat="--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64"
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d /tmp/sluice-wheels \
    $FI apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection starlette hypercorn h2 hpack hyperframe \
    priority wsproto taskgroup orjson structlog gguf pytest-asyncio xgrammar opentelemetry-sdk opentelemetry-api \
    opentelemetry-semantic-conventions opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-otlp-proto-common \
    opentelemetry-proto importlib-metadata googleapis-common-protos py-spy
cp /tmp/sluice-wheels/*.whl .whl/
# FlashInfer's wheel (59 MiB) is mostly CUDA sources of kernels sluice never builds. Keep
# every .py, the header trees and the top-level csrc files (paged prefill/decode, page ops).
$PY - "$(ls /tmp/sluice-wheels/flashinfer_python-*.whl)" .whl/"$(basename /tmp/sluice-wheels/flashinfer_python-*.whl)" <<'PYEOF'
import base64, hashlib, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
def keep(name: str, size: int) -> bool:
    if ".dist-info/" in name:
        return not name.endswith("RECORD")
    if name.endswith(".py"):
        return True
    if name.startswith("flashinfer/data/"):
        rest = name[len("flashinfer/data/"):]
        if rest.startswith(("include/", "cccl/", "cutlass/", "spdlog/")):
            return True
        if rest.startswith("csrc/"):
            return "/" not in rest[5:] or rest[5:].startswith("generated/")
        return False
    return size < 64_000
zin, record, dist = zipfile.ZipFile(src), [], ""
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if ".dist-info/" in info.filename:
            dist = info.filename.split("/")[0]
        if keep(info.filename, info.file_size):
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{info.filename},sha256={digest},{len(data)}")
    zout.writestr(f"{dist}/RECORD", "\n".join(record + [f"{dist}/RECORD,,"]) + "\n")
PYEOF
src=$($PY -c "from runtime.model_executor.model_loader import prepare_model_dir; print(prepare_model_dir(None, 'auto'))")
cp "$src"/tokenizer.json "$src"/tokenizer_config.json "$src"/generation_config.json .gpu/tokenizer/
du -sh .whl .gpu
