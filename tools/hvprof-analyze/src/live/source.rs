//! Where `record` and `top` read a live byte stream: a file being written (followed as it grows,
//! like `tail -f`), a serial device, a named pipe or standard input, a Unix socket or a TCP port
//! (QEMU's `-chardev socket` backends), or (for `top`) a capture replayed at its recorded speed.
//! A thread reads the source and hands the bytes over as they come ([`Reader`]), so the caller
//! can refresh its display and stop whenever it likes, whatever the source does.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, sync_channel};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hvprof_samplelog::{Item, Record, StreamDecoder};

/// How often a followed file is checked for growth.
const POLL: Duration = Duration::from_millis(20);
/// Bytes read at a time.
const READ_SIZE: usize = 64 << 10;
/// Bytes a replay sends at a time (a few blocks: its pacing is that fine).
const REPLAY_CHUNK: usize = 1024;
/// Chunks waiting for the reader at most (the source thread waits beyond).
const QUEUE: usize = 256;

/// A live byte stream's origin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A regular file being written: read from its start and followed as it grows.
    File(PathBuf),
    /// A character device (a serial port, `/dev/ttyS0`, `/dev/ttyUSB0`): read raw as bytes
    /// come. Its line speed and raw mode are set beforehand (`stty -F DEV 115200 raw -echo`).
    Device(PathBuf),
    /// A named pipe (QEMU's `-serial pipe:`): read to its end.
    Pipe(PathBuf),
    /// Standard input (`-`): read to its end.
    Stdin,
    /// `unix:PATH`: a Unix socket to connect to (QEMU `-chardev socket,path=PATH,server=on`);
    /// read to its end.
    Unix(PathBuf),
    /// `tcp:HOST:PORT`: a TCP port to connect to (QEMU `-chardev
    /// socket,host=HOST,port=PORT,server=on`); read to its end.
    Tcp(String),
}

impl Source {
    /// `unix:PATH`, `tcp:HOST:PORT`, `-` (standard input), or a path: a character device, a
    /// named pipe, else a file to follow.
    pub fn parse(s: &str) -> Source {
        if let Some(path) = s.strip_prefix("unix:") {
            return Source::Unix(path.into());
        }
        if let Some(addr) = s.strip_prefix("tcp:") {
            return Source::Tcp(addr.to_owned());
        }
        if s == "-" {
            return Source::Stdin;
        }
        let path = PathBuf::from(s);
        match std::fs::metadata(&path).map(|m| m.file_type()) {
            Ok(t) if t.is_char_device() => Source::Device(path),
            Ok(t) if t.is_fifo() => Source::Pipe(path),
            _ => Source::File(path),
        }
    }

    /// How long a source may stay silent before `record` stops by default: 5 s for a followed
    /// file (its writer is done), never for the others (a socket or pipe says when it ends, a
    /// serial line may be quiet for long).
    pub fn default_idle_timeout(&self) -> Option<Duration> {
        match self {
            Source::File(_) => Some(Duration::from_secs(5)),
            _ => None,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::File(p) | Source::Device(p) | Source::Pipe(p) => write!(f, "{}", p.display()),
            Source::Stdin => write!(f, "standard input"),
            Source::Unix(p) => write!(f, "unix:{}", p.display()),
            Source::Tcp(a) => write!(f, "tcp:{a}"),
        }
    }
}

/// What the reading thread hands over.
#[derive(Debug)]
pub enum Chunk {
    /// The next bytes of the stream.
    Data(Vec<u8>),
    /// The source ended (a socket or pipe closed, a replay done).
    End,
    /// Reading failed; nothing follows.
    Failed(io::Error),
}

/// The bytes of a source as they come, read on a thread of its own. Dropping it tells the
/// thread to stop (at once for a followed file or a replay; a blocking read on a socket or a
/// device ends with the process).
pub struct Reader {
    rx: Receiver<Chunk>,
    closed: Arc<AtomicBool>,
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

impl Reader {
    /// Opens `source` (errors, such as a refused connection, come here) and starts reading it.
    pub fn open(source: &Source) -> Result<Reader> {
        let (tx, rx) = sync_channel(QUEUE);
        let closed = Arc::new(AtomicBool::new(false));
        let stop = closed.clone();
        match source {
            Source::File(path) => {
                let file =
                    File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
                spawn(move || follow(file, true, &tx, &stop));
            }
            Source::Device(path) => {
                let file =
                    File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
                spawn(move || follow(file, false, &tx, &stop));
            }
            Source::Pipe(path) => {
                let file =
                    File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
                spawn(move || to_end(file, &tx));
            }
            Source::Stdin => {
                spawn(move || to_end(io::stdin().lock(), &tx));
            }
            Source::Unix(path) => {
                let s = UnixStream::connect(path)
                    .with_context(|| format!("cannot connect to unix:{}", path.display()))?;
                spawn(move || to_end(s, &tx));
            }
            Source::Tcp(addr) => {
                if !addr.contains(':') {
                    bail!("tcp:{addr}: say the port: tcp:HOST:PORT");
                }
                let s = std::net::TcpStream::connect(addr.as_str())
                    .with_context(|| format!("cannot connect to tcp:{addr}"))?;
                spawn(move || to_end(s, &tx));
            }
        }
        Ok(Reader { rx, closed })
    }

    /// Replays a capture file at its recorded speed times `speed`: each block is handed over
    /// when as much host time (its records' TSC since the first record's, at the header's
    /// `tsc_hz`) has passed, divided by `speed`. A silence longer than 10 s of host time in the
    /// capture is played as 10 s.
    pub fn replay(path: &Path, speed: f64) -> Result<Reader> {
        if !(speed.is_finite() && speed > 0.0) {
            bail!("--speed must be a positive number");
        }
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let (tx, rx) = sync_channel(QUEUE);
        let closed = Arc::new(AtomicBool::new(false));
        let stop = closed.clone();
        spawn(move || replay(&bytes, speed, &tx, &stop));
        Ok(Reader { rx, closed })
    }

    /// The next chunk, waiting at most `timeout`; `None` when nothing came meanwhile.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<Chunk> {
        match self.rx.recv_timeout(timeout) {
            Ok(c) => Some(c),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => Some(Chunk::End),
        }
    }

    /// The next chunk if one is waiting.
    pub fn try_recv(&self) -> Option<Chunk> {
        match self.rx.try_recv() {
            Ok(c) => Some(c),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Chunk::End),
        }
    }
}

fn spawn(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .name("hvprof-source".into())
        .spawn(f)
        .expect("cannot start a thread");
}

/// Reads `r` to its end.
fn to_end(mut r: impl Read, tx: &SyncSender<Chunk>) {
    let mut buf = vec![0u8; READ_SIZE];
    loop {
        match r.read(&mut buf) {
            Ok(0) => {
                let _ = tx.send(Chunk::End);
                return;
            }
            Ok(n) => {
                if tx.send(Chunk::Data(buf[..n].to_vec())).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.send(Chunk::Failed(e));
                return;
            }
        }
    }
}

/// Reads `file` and keeps reading as it grows (a device: as bytes come), until told to stop.
/// `regular`: a regular file, which fails when it shrinks below what was read (truncated by a
/// new writer).
fn follow(mut file: File, regular: bool, tx: &SyncSender<Chunk>, stop: &AtomicBool) {
    let mut buf = vec![0u8; READ_SIZE];
    let mut pos = 0u64;
    while !stop.load(Ordering::Relaxed) {
        match file.read(&mut buf) {
            Ok(0) => {
                if regular && file.metadata().is_ok_and(|m| m.len() < pos) {
                    let _ = tx.send(Chunk::Failed(io::Error::other(format!(
                        "the file was truncated after {pos} bytes (a new writer?)"
                    ))));
                    return;
                }
                std::thread::sleep(POLL);
            }
            Ok(n) => {
                pos += n as u64;
                if tx.send(Chunk::Data(buf[..n].to_vec())).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let _ = tx.send(Chunk::Failed(e));
                return;
            }
        }
    }
}

/// When a replay hands over the records up to a TSC: the host time played since the first
/// record, at `speed` times the recorded speed, silences longer than 10 s shortened to 10 s.
#[derive(Debug, Clone)]
pub struct Pacer {
    tsc_hz: u64,
    speed: f64,
    /// The latest TSC played.
    high: Option<u64>,
    /// Ticks played so far.
    played: u64,
}

impl Pacer {
    /// Longest silence played, in seconds.
    pub const MAX_SILENCE: u64 = 10;

    /// A pacer for a log of `tsc_hz` (at least 1), played `speed` times as fast as recorded.
    pub fn new(tsc_hz: u64, speed: f64) -> Self {
        Pacer {
            tsc_hz: tsc_hz.max(1),
            speed,
            high: None,
            played: 0,
        }
    }

    /// How long after the replay's start the records up to `tsc` are due.
    pub fn due(&mut self, tsc: u64) -> Duration {
        match self.high {
            None => self.high = Some(tsc),
            Some(h) if tsc > h => {
                let gap = (tsc - h).min(Self::MAX_SILENCE.saturating_mul(self.tsc_hz));
                self.played = self.played.saturating_add(gap);
                self.high = Some(tsc);
            }
            Some(_) => {}
        }
        Duration::from_secs_f64(self.played as f64 / self.tsc_hz as f64 / self.speed)
    }
}

/// Hands `bytes` over in small chunks, each when its latest record is due.
fn replay(bytes: &[u8], speed: f64, tx: &SyncSender<Chunk>, stop: &AtomicBool) {
    let start = Instant::now();
    let mut dec = StreamDecoder::new();
    let mut pacer: Option<Pacer> = None;
    for chunk in bytes.chunks(REPLAY_CHUNK) {
        let mut hz = None;
        let mut latest: Option<u64> = None;
        dec.feed(chunk, &mut |item| match item {
            Item::Header { header, .. } => hz = Some(header.tsc_hz),
            Item::Block { records, .. } => {
                latest = latest.max(records.iter().map(Record::tsc).max());
            }
            _ => {}
        });
        if pacer.is_none()
            && let Some(hz) = hz.filter(|&h| h > 0)
        {
            pacer = Some(Pacer::new(hz, speed));
        }
        if let (Some(p), Some(tsc)) = (pacer.as_mut(), latest) {
            let due = start + p.due(tsc);
            // Wait in short steps, so that a closed reader stops the replay at once.
            loop {
                if stop.load(Ordering::Relaxed) {
                    return;
                }
                let now = Instant::now();
                if now >= due {
                    break;
                }
                std::thread::sleep((due - now).min(Duration::from_millis(50)));
            }
        }
        if tx.send(Chunk::Data(chunk.to_vec())).is_err() {
            return;
        }
    }
    let _ = tx.send(Chunk::End);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_told_apart() {
        assert_eq!(
            Source::parse("unix:/tmp/s.sock"),
            Source::Unix("/tmp/s.sock".into())
        );
        assert_eq!(
            Source::parse("tcp:127.0.0.1:4555"),
            Source::Tcp("127.0.0.1:4555".into())
        );
        assert_eq!(Source::parse("-"), Source::Stdin);
        assert_eq!(
            Source::parse("/dev/null"),
            Source::Device("/dev/null".into())
        );
        assert_eq!(
            Source::parse("/no/such/file.log"),
            Source::File("/no/such/file.log".into())
        );
        assert_eq!(
            Source::parse("/no/such/file.log").default_idle_timeout(),
            Some(Duration::from_secs(5))
        );
        assert_eq!(Source::parse("tcp:h:1").default_idle_timeout(), None);
    }

    /// Records are due after the host time they were taken at, divided by the speed; time
    /// going back waits for nothing; a long silence is shortened.
    #[test]
    fn pacing_follows_the_tsc() {
        let hz = 1_000_000;
        let mut p = Pacer::new(hz, 2.0);
        assert_eq!(p.due(5_000_000), Duration::ZERO, "the first record at once");
        assert_eq!(p.due(6_000_000), Duration::from_millis(500));
        assert_eq!(
            p.due(5_500_000),
            Duration::from_millis(500),
            "a lagging pCPU"
        );
        assert_eq!(p.due(7_000_000), Duration::from_secs(1));
        // 100 s of silence play as 10 s (5 s at twice the speed).
        assert_eq!(p.due(107_000_000), Duration::from_secs(6));
    }
}
