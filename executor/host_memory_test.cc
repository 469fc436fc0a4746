// KeepFreedHostMemoryForReuse: what glibc's malloc does with a tensor-sized block afterwards.
#include "executor/host_memory.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include <gtest/gtest.h>

namespace meridian::executor {
namespace {

// An 8 MiB block (a micro-batch's activations) comes from the heap rather than an mmap of its own, and
// freeing it leaves the heap as large as it was: the next pass reuses those pages instead of faulting in
// new ones. With glibc's defaults the block is mmapped (its 128 KiB threshold) and unmapped on free.
TEST(HostMemory, ATensorSizedBlockComesFromTheHeapAndStaysMappedOnceFreed) {
  KeepFreedHostMemoryForReuse();
  constexpr size_t kBytes = size_t{8} << 20;
  const size_t mapped_before = mallinfo2().hblkhd;  // bytes in blocks mmapped on their own
  void* block = std::malloc(kBytes);
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBytes);
  EXPECT_EQ(mallinfo2().hblkhd, mapped_before);
  const size_t heap = mallinfo2().arena;  // bytes the arenas hold from the kernel
  std::free(block);
  EXPECT_EQ(mallinfo2().arena, heap);
  EXPECT_GE(mallinfo2().fordblks, kBytes);  // free for reuse
}

}  // namespace
}  // namespace meridian::executor
