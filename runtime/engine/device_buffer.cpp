// DeviceBuffer (see bspflow/engine/device_buffer.hpp).
#include "bspflow/engine/device_buffer.hpp"

#include <cstring>

#include "bspflow/base/error.hpp"

namespace bspflow {

DeviceBuffer::DeviceBuffer(Device& device, std::string name, DType dtype, std::size_t elements)
    : device_(&device), name_(std::move(name)), dtype_(dtype), elements_(elements) {
  if (elements != 0 && bytes() / elements != dtype_size(dtype)) {
    throw Error("buffer '" + name_ + "': " + std::to_string(elements) + " elements overflow");
  }
  data_ = static_cast<std::byte*>(device.arena().allocate(bytes(), name_));
  std::memset(data_, 0, bytes());
}

DeviceBuffer::~DeviceBuffer() {
  device_->arena().release(data_);
}

void DeviceBuffer::throw_mismatch(DType asked) const {
  throw Error("buffer '" + name_ + "' holds " + to_string(dtype_) + ", not " + to_string(asked));
}

Buffer make_buffer(Device& device, std::string name, DType dtype, std::size_t elements) {
  return std::make_shared<DeviceBuffer>(device, std::move(name), dtype, elements);
}

}  // namespace bspflow
