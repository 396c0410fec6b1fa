//! Live heap bytes for the hold workload (issue 9): a counting wrapper around the system allocator,
//! installed as the `distlock` binary's global allocator.
//!
//! It counts only inside a [`HeapWindow`] (the hold workload opens one): outside, each allocation pays
//! one relaxed load of a flag that nothing writes, so the other workloads, and `distlock run`, are not
//! measured through it. Inside, every allocation and free adds its requested size (and one block) to
//! two shared counters. The change of live bytes over a window is exact whenever the blocks were
//! allocated (what is allocated in the window minus what is freed in it), so a window needs no snapshot
//! of the heap. The counts are requested bytes: the allocator's own per-block overhead (glibc: 8 bytes
//! and rounding to 16, 32 at least) is not in them, which is why blocks are counted too.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};

/// The system allocator, counting inside a [`HeapWindow`]. Install it in a binary with
/// `#[global_allocator] static ALLOCATOR: CountingAllocator = CountingAllocator;`.
#[derive(Debug, Default, Clone, Copy)]
pub struct CountingAllocator;

static COUNTING: AtomicBool = AtomicBool::new(false);
/// Live bytes allocated since the window opened, less those freed since.
static LIVE: AtomicI64 = AtomicI64::new(0);
/// The highest `LIVE` since the last [`HeapWindow::reset_peak`].
static PEAK: AtomicI64 = AtomicI64::new(0);
/// Live blocks, as `LIVE` counts bytes.
static BLOCKS: AtomicI64 = AtomicI64::new(0);

fn count(bytes: i64, blocks: i64) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    if blocks != 0 {
        BLOCKS.fetch_add(blocks, Ordering::Relaxed);
    }
    // A load first: the shared line is written only when the peak moves.
    if bytes > 0 && live > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(live, Ordering::Relaxed);
    }
}

fn size(layout: Layout) -> i64 {
    i64::try_from(layout.size()).unwrap_or(i64::MAX)
}

// SAFETY: every call is passed to `System` unchanged; the counting touches only atomics (no allocation).
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            count(size(layout), 1);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() && COUNTING.load(Ordering::Relaxed) {
            count(size(layout), 1);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) };
        if COUNTING.load(Ordering::Relaxed) {
            count(-size(layout), -1);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, passed on.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() && COUNTING.load(Ordering::Relaxed) {
            let grown = i64::try_from(new_size).unwrap_or(i64::MAX) - size(layout);
            count(grown, 0);
        }
        new
    }
}

/// Live heap, relative to the window's opening.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapReading {
    /// Bytes allocated and not freed since the window opened (negative if more was freed).
    pub live_bytes: i64,
    /// Blocks, likewise.
    pub live_blocks: i64,
    /// The highest `live_bytes` since the window opened or its peak was last reset.
    pub peak_bytes: i64,
}

/// Counting, from [`open`](Self::open) until dropped. One at a time (the counters are global); the
/// bench opens one only in the hold workload.
#[derive(Debug)]
pub struct HeapWindow(());

impl HeapWindow {
    /// Starts counting from zero; `None` if the [`CountingAllocator`] is not the global allocator (a
    /// test allocation was not seen).
    pub fn open() -> Option<Self> {
        LIVE.store(0, Ordering::Relaxed);
        PEAK.store(0, Ordering::Relaxed);
        BLOCKS.store(0, Ordering::Relaxed);
        COUNTING.store(true, Ordering::SeqCst);
        let window = Self(());
        let probe = std::hint::black_box(Box::new([0_u8; 64]));
        let seen = PEAK.load(Ordering::Relaxed) >= 64;
        drop(probe);
        seen.then_some(window)
    }

    /// The counts now.
    pub fn read(&self) -> HeapReading {
        let live_bytes = LIVE.load(Ordering::Relaxed);
        HeapReading {
            live_bytes,
            live_blocks: BLOCKS.load(Ordering::Relaxed),
            // An allocation between its two counter updates may have moved `LIVE` and not yet `PEAK`.
            peak_bytes: PEAK.load(Ordering::Relaxed).max(live_bytes),
        }
    }

    /// Makes the peak the live count now, so the next reading's peak is the highest since this call.
    pub fn reset_peak(&self) {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

impl Drop for HeapWindow {
    fn drop(&mut self) {
        COUNTING.store(false, Ordering::SeqCst);
    }
}

/// What glibc's allocator holds, all arenas together (`mallinfo2`): the side of resident memory the
/// live-heap count does not see, i.e. the allocator's per-block overhead and the free memory it keeps
/// in its arenas rather than returning it to the system.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocatorReading {
    /// Bytes the arenas took from the system (`arena`), plus the chunks mapped on their own (`hblkhd`).
    pub system_bytes: u64,
    /// Bytes in allocated chunks, their headers and rounding included (`uordblks` + `hblkhd`).
    pub in_use_bytes: u64,
    /// Free bytes kept in the arenas (`fordblks`).
    pub free_bytes: u64,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
mod glibc {
    /// `struct mallinfo2` (glibc 2.33+): every field a `size_t`.
    #[repr(C)]
    pub(super) struct MallInfo2 {
        pub arena: usize,
        pub ordblks: usize,
        pub smblks: usize,
        pub hblks: usize,
        pub hblkhd: usize,
        pub usmblks: usize,
        pub fsmblks: usize,
        pub uordblks: usize,
        pub fordblks: usize,
        pub keepcost: usize,
    }

    extern "C" {
        pub(super) fn mallinfo2() -> MallInfo2;
    }
}

/// The allocator's totals now; `None` where the allocator is not glibc's.
pub fn allocator_reading() -> Option<AllocatorReading> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallinfo2` takes no argument and returns a plain struct; it locks each arena in turn.
        let info = unsafe { glibc::mallinfo2() };
        let wide = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        Some(AllocatorReading {
            system_bytes: wide(info.arena) + wide(info.hblkhd),
            in_use_bytes: wide(info.uordblks) + wide(info.hblkhd),
            free_bytes: wide(info.fordblks),
        })
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::HeapWindow;

    /// A test binary has the system allocator: the window says so rather than report zeros.
    #[test]
    fn without_the_counting_allocator_no_window_opens() {
        assert!(HeapWindow::open().is_none());
    }
}
