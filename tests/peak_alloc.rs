//! A global allocator that records the peak of live heap bytes, so a test can assert that an
//! input was handled within bounded memory.
//!
//! ```ignore
//! #[global_allocator]
//! static ALLOC: PeakAlloc = PeakAlloc::new();
//! ALLOC.reset_peak();
//! work();
//! assert!(ALLOC.peak_since_reset() < 64 << 20);
//! ```
//! A `vec![0; n]` counts in full even though the system may not touch its pages: what is
//! bounded is what the program asked for (virtual memory), the stricter measure.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator with a live-bytes counter and its high-water mark.
#[derive(Debug)]
pub struct PeakAlloc {
    live: AtomicUsize,
    peak: AtomicUsize,
}

impl PeakAlloc {
    /// A counter at zero.
    pub const fn new() -> Self {
        PeakAlloc {
            live: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
        }
    }

    /// Heap bytes live now.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Starts a new measurement: the peak becomes the bytes live now.
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::SeqCst);
    }

    /// The most bytes live at once since [`PeakAlloc::reset_peak`], minus those live at the
    /// reset: what the measured work added at its worst.
    pub fn peak_since(&self, base: usize) -> usize {
        self.peak.load(Ordering::SeqCst).saturating_sub(base)
    }

    fn add(&self, n: usize) {
        let now = self.live.fetch_add(n, Ordering::SeqCst) + n;
        self.peak.fetch_max(now, Ordering::SeqCst);
    }

    fn sub(&self, n: usize) {
        self.live.fetch_sub(n, Ordering::SeqCst);
    }
}

impl Default for PeakAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method forwards to `System` with the caller's pointer and layout unchanged, so
// `System`'s guarantees hold; the counters are only atomics beside it.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller upholds `alloc`'s contract (non-zero size), passed on as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.add(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by this allocator (so by `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        self.sub(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr`/`layout` come from this allocator; the caller upholds the new size's
        // contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                self.add(new_size - layout.size());
            } else {
                self.sub(layout.size() - new_size);
            }
        }
        p
    }
}
