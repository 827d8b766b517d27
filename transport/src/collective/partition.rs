//! How a buffer of `len` elements is cut into one block per rank when `len` is not a multiple of
//! the rank count: the first `len % parts` blocks get one extra element.

use std::ops::Range;

/// The elements of block `i` when `len` elements are cut into `parts` blocks.
pub fn block_range(len: usize, parts: usize, i: usize) -> Range<usize> {
    let base = len / parts.max(1);
    let rem = len % parts.max(1);
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

/// Splits `buf` into a shared view of `read` and a mutable view of `write` (disjoint ranges).
pub(crate) fn split_disjoint<T>(
    buf: &mut [T],
    read: Range<usize>,
    write: Range<usize>,
) -> (&[T], &mut [T]) {
    if read.start >= write.end {
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.len()], &mut lo[write])
    } else {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.len()])
    }
}

/// The `c`-th chunk of `range` when it is cut into chunks of `chunk` elements.
pub(crate) fn chunk_of(range: &Range<usize>, chunk: usize, c: usize) -> Range<usize> {
    let start = (range.start + c * chunk).min(range.end);
    start..(start + chunk).min(range.end)
}

/// How many chunks of `chunk` elements cover `len` elements (at least one, so that an empty
/// block still exchanges one empty message and keeps both sides in step).
pub(crate) fn chunks(len: usize, chunk: usize) -> usize {
    len.div_ceil(chunk.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_buffer_in_order() {
        for len in 0..20 {
            for parts in 1..7 {
                let mut next = 0;
                for i in 0..parts {
                    let r = block_range(len, parts, i);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn disjoint_views() {
        let mut v = [0, 1, 2, 3, 4, 5];
        let (r, w) = split_disjoint(&mut v, 4..6, 0..2);
        assert_eq!(r, [4, 5]);
        w.copy_from_slice(&[9, 9]);
        let (r, w) = split_disjoint(&mut v, 0..2, 3..4);
        assert_eq!(r, [9, 9]);
        assert_eq!(w, [3]);
    }
}
