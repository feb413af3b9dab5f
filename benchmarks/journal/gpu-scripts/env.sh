# Source on the GPU host (no network there): install the carried wheels (.whl/, made by
# ../shared/device/fetch-wheels.sh), put the checkout on PYTHONPATH, keep NVLink multicast off.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 SHARDSMITH_HOST=${SHARDSMITH_HOST:-h200x2} SHARDSMITH_CACHE=${SHARDSMITH_CACHE:-/tmp/sscache}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
