/// @file
/// DeviceBuffer: typed memory in one device's arena, what programs compute on and copy
/// between (Poplar's tensors on a device).
/// Guide: runtime/engine/README.md.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string>

#include "bspflow/data/tensor.hpp"
#include "bspflow/devices/device.hpp"

namespace bspflow {

/// Memory in one device's arena, typed as `elements` of a DType. Counts against the device's
/// memory budget. Zero-filled at creation.
/// Contract of every member: any; non-blocking; no-alloc; noexcept, unless tagged.
class DeviceBuffer {
 public:
  /// Takes the memory from the device's arena. Throws OutOfMemoryError if it does not fit,
  /// bspflow::Error if its byte size overflows.
  /// Contract: host; non-blocking; allocates; throws Error.
  DeviceBuffer(Device& device, std::string name, DType dtype, std::size_t elements);
  /// Gives the memory back to the arena.
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  /// The device whose arena holds the buffer.
  Device& device() const noexcept { return *device_; }
  /// The name its memory goes by in the arena's reports.
  const std::string& name() const noexcept { return name_; }
  /// The element type.
  DType dtype() const noexcept { return dtype_; }
  /// How many elements it holds.
  std::size_t elements() const noexcept { return elements_; }
  /// Its size in bytes: elements() times the element size.
  std::size_t bytes() const noexcept { return elements_ * dtype_size(dtype_); }
  /// The contents as bytes.
  std::span<std::byte> raw() noexcept { return {data_, bytes()}; }
  /// The contents as bytes, read-only.
  std::span<const std::byte> raw() const noexcept { return {data_, bytes()}; }
  /// The elements as E (uint8_t, uint16_t for fp16, float, int32_t). Throws bspflow::Error
  /// if E does not match dtype().
  /// Contract: any; non-blocking; no-alloc; throws Error.
  template <class E>
  std::span<E> as() {
    static_assert(kIsElement<E>,
                  "DeviceBuffer::as<E>: E must be uint8_t, uint16_t (fp16), "
                  "float or int32_t");
    if (dtype_of<E>() != dtype_) throw_mismatch(dtype_of<E>());
    return {reinterpret_cast<E*>(data_), elements_};
  }

 private:
  [[noreturn]] void throw_mismatch(DType asked) const;

  Device* device_;
  std::string name_;
  DType dtype_;
  std::size_t elements_;
  std::byte* data_;
};
/// A shared DeviceBuffer: what program nodes hold.
using Buffer = std::shared_ptr<DeviceBuffer>;
/// A new DeviceBuffer (see its constructor), shared.
/// Contract: host; non-blocking; allocates; throws Error.
Buffer make_buffer(Device& device, std::string name, DType dtype, std::size_t elements);

}  // namespace bspflow
