//! A VM's output store (`output=SIZE` in its module line): the bytes its programs hand the
//! hypervisor through the output leaf (docs/GUEST-ABI.md, "Output"), kept whole and in
//! order, and sent after the run as output frames of the sample log, where
//! `hvprof-analyze output` finds them. The console line (115,200 baud, with a rate limit per
//! VM) could carry a few KB a second; a program's megabytes go here instead.
//!
//! The store is a byte buffer of records: the stream (1 stdout, 2 stderr), the length (16
//! bits, little-endian, at most `MAX_OUTPUT_CHUNK`), the bytes; one record is one output frame.
//! What does not fit is counted as lost.

use hvprof_samplelog::{MAX_OUTPUT_CHUNK, OutputStream};

/// Record header bytes: the stream and the length.
const HEADER: usize = 3;

pub struct OutputStore {
    buf: &'static mut [u8],
    len: usize,
    lost: u64,
    kept: [u64; 2],
}

impl OutputStore {
    /// A store in `buf` (memory the store owns for the life of the machine).
    pub fn new(buf: &'static mut [u8]) -> Self {
        OutputStore {
            buf,
            len: 0,
            lost: 0,
            kept: [0; 2],
        }
    }

    /// Bytes it can still take (at least what one more record's bytes can be).
    pub fn free(&self) -> usize {
        (self.buf.len() - self.len).saturating_sub(HEADER)
    }

    /// Keeps as much of `bytes` as fits, as records of `stream` (stdout or stderr; `Lost` takes
    /// nothing); counts the rest as lost. Returns how many bytes it kept.
    pub fn push(&mut self, stream: OutputStream, bytes: &[u8]) -> usize {
        let index = match stream {
            OutputStream::Stdout => 0,
            OutputStream::Stderr => 1,
            OutputStream::Lost => return 0,
        };
        let mut taken = 0;
        for piece in bytes.chunks(MAX_OUTPUT_CHUNK) {
            let n = piece.len().min(self.free());
            if n == 0 {
                break;
            }
            let at = self.len;
            self.buf[at] = stream as u8;
            self.buf[at + 1..at + HEADER].copy_from_slice(&(n as u16).to_le_bytes());
            self.buf[at + HEADER..at + HEADER + n].copy_from_slice(&piece[..n]);
            self.len += HEADER + n;
            taken += n;
            if n < piece.len() {
                break;
            }
        }
        self.kept[index] += taken as u64;
        self.lost += (bytes.len() - taken) as u64;
        taken
    }

    /// Counts `n` bytes a guest meant to hand over but could not (a bad request).
    pub fn lose(&mut self, n: u64) {
        self.lost = self.lost.saturating_add(n);
    }

    /// Bytes lost so far.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// Bytes kept of stdout and of stderr.
    pub fn kept(&self) -> (u64, u64) {
        (self.kept[0], self.kept[1])
    }

    /// The records, in order: (stream, bytes), each at most `MAX_OUTPUT_CHUNK` bytes.
    pub fn records(&self) -> impl Iterator<Item = (OutputStream, &[u8])> {
        let mut at = 0;
        let data = &self.buf[..self.len];
        core::iter::from_fn(move || {
            let header = data.get(at..at + HEADER)?;
            let stream = OutputStream::from_u8(header[0])?;
            let n = usize::from(u16::from_le_bytes([header[1], header[2]]));
            let bytes = data.get(at + HEADER..at + HEADER + n)?;
            at += HEADER + n;
            Some((stream, bytes))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;
    use alloc::vec::Vec;

    fn store(size: usize) -> OutputStore {
        OutputStore::new(vec![0u8; size].leak())
    }

    #[test]
    fn keeps_streams_in_order_in_chunks() {
        let mut s = store(8192);
        let big: Vec<u8> = (0..2500u32).map(|i| i as u8).collect();
        assert_eq!(s.push(OutputStream::Stdout, b"a\n"), 2);
        assert_eq!(s.push(OutputStream::Stderr, &big), 2500);
        assert_eq!(s.push(OutputStream::Stdout, b"\0z"), 2);
        let r: Vec<(OutputStream, Vec<u8>)> = s.records().map(|(st, b)| (st, b.to_vec())).collect();
        assert_eq!(r.len(), 5);
        assert_eq!(r[0], (OutputStream::Stdout, b"a\n".to_vec()));
        assert_eq!(r[1].1.len(), MAX_OUTPUT_CHUNK);
        let err: Vec<u8> = r[1..4].iter().flat_map(|(_, b)| b.clone()).collect();
        assert_eq!(err, big);
        assert!(r[1..4].iter().all(|(st, _)| *st == OutputStream::Stderr));
        assert_eq!(r[4], (OutputStream::Stdout, b"\0z".to_vec()));
        assert_eq!(s.kept(), (4, 2500));
        assert_eq!(s.lost(), 0);
    }

    #[test]
    fn what_does_not_fit_is_lost_and_counted() {
        let mut s = store(100);
        assert_eq!(s.push(OutputStream::Stdout, &[7u8; 90]), 90);
        // 7 bytes left: a header and 4 bytes.
        assert_eq!(s.free(), 4);
        assert_eq!(s.push(OutputStream::Stdout, &[8u8; 10]), 4);
        assert_eq!(s.free(), 0);
        assert_eq!(s.push(OutputStream::Stderr, b"more"), 0);
        assert_eq!(s.push(OutputStream::Lost, b"xx"), 0);
        s.lose(5);
        assert_eq!(s.lost(), 6 + 4 + 5);
        let total: usize = s.records().map(|(_, b)| b.len()).sum();
        assert_eq!(total, 94);
    }
}
