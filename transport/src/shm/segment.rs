//! Shared-memory segments: files under `/dev/shm` mapped by both tasks of a pair.
//!
//! The sender creates a segment (named after its pid, so a crashed task's leftovers can be told
//! apart), the receiver maps it and unlinks the name at once: from then on the memory lives only
//! as long as the two mappings, and a crash of either side leaves nothing behind. A name that a
//! task created but nobody mapped (it died in between) is removed by the next task that binds a
//! shm plane on the host ([`sweep_dead`]), once its pid is gone.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Every segment's file name starts with this.
pub const PREFIX: &str = "dflow-shm-";

/// Longest segment name accepted from a peer.
const MAX_NAME: usize = 200;

/// Where segments live.
pub fn shm_dir() -> PathBuf {
    PathBuf::from("/dev/shm")
}

/// A fresh segment name for this process: `dflow-shm-<pid>-<n>-<what>`, `what` reduced to
/// `[A-Za-z0-9_.-]`.
pub fn new_name(what: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let what: String = what
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(120)
        .collect();
    format!("{PREFIX}{}-{n}-{what}", std::process::id())
}

/// The path of a segment name received from a peer, refused unless it is one of ours: the
/// prefix, a plain file name (no `/`, no `..`), bounded length.
pub fn checked_path(name: &str) -> Result<PathBuf, String> {
    let ok = name.len() <= MAX_NAME
        && name.starts_with(PREFIX)
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-');
    if ok {
        Ok(shm_dir().join(name))
    } else {
        Err(format!("refusing shared-memory segment name {name:?}"))
    }
}

/// The pid in a segment name, if it has the `dflow-shm-<pid>-` form.
fn pid_of(name: &str) -> Option<u32> {
    name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
}

/// Removes segments left by processes that no longer exist (they died between creating a
/// segment and its peer mapping it). Returns how many were removed.
pub fn sweep_dead() -> usize {
    let Ok(dir) = std::fs::read_dir(shm_dir()) else {
        return 0;
    };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(pid_of) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists()
            && std::fs::remove_file(entry.path()).is_ok()
        {
            removed += 1;
        }
    }
    removed
}

/// Names of the segments under [`shm_dir`] created by process `pid` (for tests and checks).
pub fn segments_of(pid: u32) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(shm_dir()) else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| pid_of(n) == Some(pid))
        .collect()
}

/// One shared mapping of a whole segment, read-write, unmapped on drop.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory with no thread affinity; every access goes through
// atomics (headers) or through the slot protocol, which gives one side at a time the right to
// write a slot's bytes.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out raw pointers and atomics.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Creates segment `path` of `len` bytes (zero-filled; the name must not exist) and maps it.
    pub fn create(path: &Path, len: usize) -> io::Result<Mapping> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let mapped = file
            .set_len(len as u64)
            .and_then(|()| Self::map(&file, len));
        if mapped.is_err() {
            let _ = std::fs::remove_file(path);
        }
        mapped
    }

    /// Maps the existing segment `path`, which must be exactly `len` bytes long.
    pub fn open(path: &Path, len: usize) -> io::Result<Mapping> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let actual = file.metadata()?.len();
        if actual != len as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("segment has {actual} bytes, expected {len}"),
            ));
        }
        Self::map(&file, len)
    }

    fn map(file: &File, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty segment"));
        }
        use rustix::mm::{mmap, MapFlags, ProtFlags};
        // SAFETY: a fresh shared mapping of a file we hold open, at an address the kernel picks:
        // it aliases no Rust object. The file is exactly `len` bytes long, so every mapped page is
        // backed (no SIGBUS); the segment is only truncated by nobody (names are unlinked, never
        // shrunk).
        let ptr = unsafe {
            mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                file,
                0,
            )
        }?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mapping { ptr, len })
    }

    /// The first byte (page-aligned).
    pub fn base(&self) -> NonNull<u8> {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (an empty segment cannot be mapped); for symmetry with [`Mapping::len`].
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when `ptr` lies inside the mapping.
    pub fn contains(&self, ptr: *const u8) -> bool {
        let (start, p) = (self.ptr.as_ptr() as usize, ptr as usize);
        p >= start && p < start + self.len
    }

    /// The `u32` atomic at byte `offset`.
    ///
    /// # Panics
    ///
    /// When `offset` is misaligned or out of range (a bug in the layout constants).
    pub fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len,
            "bad atomic offset {offset}"
        );
        // SAFETY: in bounds and 4-aligned (the base is page-aligned); the memory lives as long as
        // `&self`, and is only ever accessed atomically at this offset by both processes.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU32>() }
    }

    /// The `u64` atomic at byte `offset` (see [`Mapping::atomic_u32`]).
    pub fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset % 8 == 0 && offset + 8 <= self.len,
            "bad atomic offset {offset}"
        );
        // SAFETY: as in `atomic_u32`, 8-aligned.
        unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and nothing borrows the mapping
        // any more: views of it (buffers, atomics) hold an `Arc<Mapping>` or a `&Mapping`.
        if let Err(e) = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) } {
            tracing::warn!("munmap of a shared-memory segment failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_dead_segments_swept() {
        let name = new_name("worker:0->ps:0/slot 1");
        assert!(name.starts_with(&format!("{PREFIX}{}-", std::process::id())));
        assert!(checked_path(&name).is_ok());
        for bad in [
            "../etc/passwd",
            "dflow-shm-1/../../x",
            "other",
            "dflow-shm-1 x",
        ] {
            assert!(checked_path(bad).is_err(), "{bad}");
        }
        // A segment of a pid that cannot exist is swept; ours are kept.
        let dead = shm_dir().join(format!("{PREFIX}4294967295-0-test"));
        std::fs::write(&dead, b"x").unwrap();
        let path = checked_path(&name).unwrap();
        let map = Mapping::create(&path, 4096).unwrap();
        assert!(sweep_dead() >= 1);
        assert!(!dead.exists());
        assert!(path.exists());
        // Two mappings of one segment share memory.
        let other = Mapping::open(&path, 4096).unwrap();
        assert!(
            Mapping::open(&path, 8192).is_err(),
            "wrong length is refused"
        );
        std::fs::remove_file(&path).unwrap();
        map.atomic_u32(64).store(7, Ordering::SeqCst);
        assert_eq!(other.atomic_u32(64).load(Ordering::SeqCst), 7);
        assert!(map.contains(map.base().as_ptr()));
        assert!(!map.contains(other.base().as_ptr()));
    }
}
