# A CPU DLPack tensor's memory as a Python buffer (included by sampling.pyx).
#
# Why: the sampler model gets its bfloat16 logits from Triton's Python
# backend, whose ``as_numpy`` refuses BF16 (python_backend src/pb_tensor.cc,
# ``PbTensor::AsNumpy``) and whose ``to_dlpack`` gives a capsule numpy cannot
# import either (``numpy.from_dlpack`` has no bfloat16). torch can, but its
# import costs each sampler instance seconds at start and its dispatch a
# cold ~100 us a request in the stub (docs/COPIES.md). Reading the capsule
# takes a few struct fields; ``sampling.dlpack_array`` views the buffer as
# numpy with the right dtype.

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_WRITABLE
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid

cdef extern from *:
    """
    /* DLPack's ABI (dlpack.h, v0.x and 1.x unversioned capsules): only the
       fields read here. */
    typedef struct { int32_t device_type; int32_t device_id; } SsDLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } SsDLDataType;
    typedef struct {
        void* data; SsDLDevice device; int32_t ndim; SsDLDataType dtype;
        int64_t* shape; int64_t* strides; uint64_t byte_offset;
    } SsDLTensor;
    typedef struct { SsDLTensor dl_tensor; void* manager_ctx; void* deleter; } SsDLManagedTensor;
    """
    ctypedef struct SsDLDevice:
        int32_t device_type
    ctypedef struct SsDLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct SsDLTensor:
        void* data
        SsDLDevice device
        int32_t ndim
        SsDLDataType dtype
        int64_t* shape
        int64_t* strides
        uint64_t byte_offset
    ctypedef struct SsDLManagedTensor:
        SsDLTensor dl_tensor

# dlpack.h's DLDeviceType values a CPU reader may read
cdef int32_t DL_CPU = 1
cdef int32_t DL_CUDA_HOST = 3


cdef class DLPackBytes:
    """The bytes of a contiguous CPU tensor behind a DLPack capsule, as a
    read-only one-dimensional buffer of unsigned bytes.

    capsule: an unconsumed capsule named "dltensor" (a producer's
    ``to_dlpack()`` / ``__dlpack__()``). It is left unconsumed and held, so
    its producer's destructor frees the tensor once this object (and every
    buffer taken from it) is gone. shape: the tensor's dims; code, bits:
    its DLDataType (code 0 int, 1 uint, 2 float, 4 bfloat). Raises
    ValueError for a consumed or foreign capsule, a device tensor, vector
    lanes, or strides that are not row-major contiguous."""

    cdef object capsule
    cdef char* data
    cdef Py_ssize_t nbytes
    cdef Py_ssize_t buffer_shape[1]
    cdef readonly tuple shape
    cdef readonly int code, bits

    def __cinit__(self, capsule):
        if not PyCapsule_IsValid(capsule, "dltensor"):
            raise ValueError("expected an unconsumed DLPack capsule (named 'dltensor')")
        cdef SsDLTensor* tensor = &(<SsDLManagedTensor*>PyCapsule_GetPointer(
            capsule, "dltensor")).dl_tensor
        if tensor.device.device_type != DL_CPU and tensor.device.device_type != DL_CUDA_HOST:
            raise ValueError(f"the DLPack tensor must be in host memory, got device type "
                             f"{tensor.device.device_type}")
        if tensor.dtype.lanes != 1 or tensor.dtype.bits % 8 or tensor.dtype.bits == 0:
            raise ValueError(f"the DLPack tensor must have one lane of whole bytes, got "
                             f"{tensor.dtype.lanes} lanes of {tensor.dtype.bits} bits")
        cdef Py_ssize_t itemsize = tensor.dtype.bits // 8
        cdef Py_ssize_t count = 1
        cdef Py_ssize_t expected = 1
        cdef int i
        for i in range(tensor.ndim - 1, -1, -1):
            if (tensor.strides != NULL and tensor.shape[i] > 1
                    and tensor.strides[i] != expected):
                raise ValueError("the DLPack tensor must be row-major contiguous")
            expected *= tensor.shape[i]
            count *= tensor.shape[i]
        self.capsule = capsule
        self.data = <char*>tensor.data + tensor.byte_offset
        self.nbytes = count * itemsize
        self.buffer_shape[0] = self.nbytes
        self.shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
        self.code, self.bits = tensor.dtype.code, tensor.dtype.bits

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("a DLPack tensor's bytes are read-only here")
        buffer.buf = self.data
        buffer.obj = self
        buffer.len = self.nbytes
        buffer.readonly = 1
        buffer.itemsize = 1
        buffer.format = NULL
        if flags & PyBUF_FORMAT:
            buffer.format = b"B"
        buffer.ndim = 1
        buffer.shape = self.buffer_shape
        buffer.strides = NULL
        buffer.suboffsets = NULL
        buffer.internal = NULL

    def __releasebuffer__(self, Py_buffer* buffer):
        pass
