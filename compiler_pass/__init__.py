"""The compiler: TVM passes that instrument kernels and ``paella compile``'s bundles.

TVM is imported here first, without torch (:mod:`paella.tvm_loader`): every compiler
module imports TVM at its top."""
from paella.tvm_loader import load_tvm

load_tvm()
