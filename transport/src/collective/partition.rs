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
}
