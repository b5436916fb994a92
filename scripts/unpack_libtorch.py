#!/usr/bin/env python3
"""Unpacks the parts of a torch wheel that a C++ build needs into a LibTorch-style prefix.

By default the wheel's CUDA libraries (libtorch_cuda.so and friends) are left out: on a CPU
machine meshtorch links only torch_cpu and c10. With --cuda, every C++ library of the wheel is
unpacked too (libtorch_cuda, libc10_cuda, ...), for a CUDA build (-DMESHTORCH_CUDA=ON) against
the CUDA toolkit installed on the machine; use a prefix of its own for it. With
--shared-libs-only, copies the .so files of any wheel (e.g. nvidia-cuda-runtime) into PREFIX/lib.
"""
import argparse
import os
import shutil
import sys
import zipfile

CPU_LIBS = {"libtorch_cpu.so", "libc10.so", "libgomp.so.1", "libtorch.so", "libshm.so",
            "libtorch_global_deps.so"}
# The Python extension's library: a C++ program never links it.
PYTHON_ONLY_LIBS = {"libtorch_python.so"}


def wanted_library(base: str, cuda: bool) -> bool:
    if base in CPU_LIBS:
        return True
    return cuda and ".so" in base and base not in PYTHON_ONLY_LIBS


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("wheel")
    parser.add_argument("prefix")
    parser.add_argument("--shared-libs-only", action="store_true")
    parser.add_argument("--cuda", action="store_true", help="unpack the CUDA libraries too")
    args = parser.parse_args()
    os.makedirs(os.path.join(args.prefix, "lib"), exist_ok=True)
    with zipfile.ZipFile(args.wheel) as wheel:
        for info in wheel.infolist():
            name = info.filename
            if info.is_dir():
                continue
            if args.shared_libs_only:
                base = os.path.basename(name)
                if ".so" in base:
                    target = os.path.join(args.prefix, "lib", base)
                else:
                    continue
            elif name.startswith(("torch/include/", "torch/share/cmake/")):
                target = os.path.join(args.prefix, name[len("torch/"):])
            elif (name.startswith("torch/lib/") and name.count("/") == 2
                  and wanted_library(os.path.basename(name), args.cuda)):
                target = os.path.join(args.prefix, "lib", os.path.basename(name))
            else:
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with wheel.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
