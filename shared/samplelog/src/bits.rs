//! Byte- and bit-level primitives of the wire format: LEB128 varints, zigzag, the LSB-first
//! bitstream, Rice codes with escape, length-prefixed integers.

/// Zigzag: 0, -1, 1, -2, … → 0, 1, 2, 3, …
#[inline]
pub(crate) const fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

/// Inverse of [`zigzag`].
#[cfg(feature = "std")]
#[inline]
pub(crate) const fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Number of significant bits (0 for 0).
#[inline]
pub(crate) const fn bit_len(v: u64) -> u32 {
    64 - v.leading_zeros()
}

/// Rice quotients at or above this are escaped.
pub(crate) const RICE_ESCAPE: u64 = 3;

/// The low 8 bits of `v`, without a cast: the next byte a writer emits, or a field of at most 8
/// bits read back (which fits by construction).
#[inline]
pub(crate) const fn low_u8(v: u64) -> u8 {
    v.to_le_bytes()[0]
}

/// The low 32 bits of `v`, without a cast, for values below 2^32 by construction (bit counts,
/// fields of at most 32 bits read back).
#[inline]
pub(crate) const fn low_u32(v: u64) -> u32 {
    let b = v.to_le_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}
/// Bits of the length field of a Rice escape.
const RICE_LEN_BITS: u32 = 6;

/// Bits `rice(k, v)` takes.
#[cfg(test)]
pub(crate) const fn rice_bits(k: u32, v: u64) -> u32 {
    let q = v >> k;
    if q < RICE_ESCAPE {
        low_u32(q) + 1 + k
    } else {
        low_u32(RICE_ESCAPE) + RICE_LEN_BITS + bit_len(v) - 1
    }
}

/// Writes bytes into a fixed slice; remembers overflow instead of panicking.
pub(crate) struct ByteWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
    overflow: bool,
}

impl<'a> ByteWriter<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            overflow: false,
        }
    }

    pub(crate) fn u8(&mut self, v: u8) {
        match self.buf.get_mut(self.pos) {
            Some(slot) => {
                *slot = v;
                self.pos += 1;
            }
            None => self.overflow = true,
        }
    }

    pub(crate) fn bytes(&mut self, v: &[u8]) {
        match self.buf.get_mut(self.pos..self.pos + v.len()) {
            Some(dst) => {
                dst.copy_from_slice(v);
                self.pos += v.len();
            }
            None => self.overflow = true,
        }
    }

    /// Unsigned LEB128.
    pub(crate) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.u8(low_u8(v) | 0x80);
            v >>= 7;
        }
        self.u8(low_u8(v));
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn overflowed(&self) -> bool {
        self.overflow
    }
}

/// Structural decoding failure (the caller turns it into a damage report).
#[cfg(feature = "std")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Malformed;

/// Reads bytes from a slice.
#[cfg(feature = "std")]
pub(crate) struct ByteReader<'a> {
    buf: &'a [u8],
    pos: usize,
}

#[cfg(feature = "std")]
impl<'a> ByteReader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Self { buf, pos: 0 }
    }

    pub(crate) fn u8(&mut self) -> Result<u8, Malformed> {
        let v = *self.buf.get(self.pos).ok_or(Malformed)?;
        self.pos += 1;
        Ok(v)
    }

    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let end = self.pos.checked_add(n).ok_or(Malformed)?;
        let v = self.buf.get(self.pos..end).ok_or(Malformed)?;
        self.pos = end;
        Ok(v)
    }

    /// Unsigned LEB128, at most 10 bytes, no bits beyond 64.
    pub(crate) fn varint(&mut self) -> Result<u64, Malformed> {
        let mut v = 0u64;
        for i in 0..10 {
            let b = self.u8()?;
            let payload = u64::from(b & 0x7f);
            if i == 9 && payload > 1 {
                return Err(Malformed);
            }
            v |= payload << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Malformed)
    }

    pub(crate) fn varint_u16(&mut self) -> Result<u16, Malformed> {
        u16::try_from(self.varint()?).map_err(|_| Malformed)
    }

    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    pub(crate) fn rest(&self) -> &'a [u8] {
        &self.buf[self.pos..]
    }
}

/// LSB-first bit writer into a fixed slice: bit `i` of the stream is bit `i % 8` of byte `i / 8`;
/// a multi-bit field is written least significant bit first.
pub(crate) struct BitWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
    acc: u64,
    n: u32,
    overflow: bool,
}

impl<'a> BitWriter<'a> {
    pub(crate) fn new(buf: &'a mut [u8]) -> Self {
        Self {
            buf,
            pos: 0,
            acc: 0,
            n: 0,
            overflow: false,
        }
    }

    /// Writes the low `bits` bits of `v` (`bits` ≤ 64).
    #[inline]
    pub(crate) fn put(&mut self, v: u64, bits: u32) {
        if bits > 32 {
            self.put(v & 0xffff_ffff, 32);
            self.put(v >> 32, bits - 32);
            return;
        }
        if bits == 0 {
            return;
        }
        let v = v & ((1u64 << bits) - 1);
        self.acc |= v << self.n;
        self.n += bits;
        while self.n >= 8 {
            self.emit(low_u8(self.acc));
            self.acc >>= 8;
            self.n -= 8;
        }
    }

    #[inline]
    fn emit(&mut self, b: u8) {
        match self.buf.get_mut(self.pos) {
            Some(slot) => {
                *slot = b;
                self.pos += 1;
            }
            None => self.overflow = true,
        }
    }

    #[inline]
    pub(crate) fn bit(&mut self, b: bool) {
        self.put(u64::from(b), 1);
    }

    /// Rice code with parameter `k` and escape: `q = v >> k`; if `q` < 3: `q` one bits, a zero
    /// bit, then the low `k` bits of `v`; else three one bits, `n - k - 2` in 6 bits where `n` is
    /// the bit length of `v` (then `n ≥ k + 2`), then the low `n - 1` bits of `v` (its top bit is
    /// implied).
    #[inline]
    pub(crate) fn rice(&mut self, k: u32, v: u64) {
        let q = v >> k;
        if q < RICE_ESCAPE {
            self.put((1u64 << q) - 1, low_u32(q) + 1);
            self.put(v, k);
        } else {
            self.put(0b111, low_u32(RICE_ESCAPE));
            let n = bit_len(v);
            self.put(u64::from(n - k - 2), RICE_LEN_BITS);
            self.put(v, n - 1);
        }
    }

    /// Plain Rice code (no escape) of a small value: `v >> k` one bits, a zero bit, the low `k`
    /// bits of `v`.
    #[inline]
    pub(crate) fn small_rice(&mut self, k: u32, v: u64) {
        let q = v >> k;
        self.put((1u64 << q) - 1, low_u32(q) + 1);
        self.put(v, k);
    }

    /// Length-prefixed integer: the bit length `n` of `v` in `len_bits` bits, then `n` bits of `v`.
    #[inline]
    pub(crate) fn lp(&mut self, v: u64, len_bits: u32) {
        let n = bit_len(v);
        self.put(u64::from(n), len_bits);
        self.put(v, n);
    }

    /// Flushes the last partial byte (zero padding); returns bytes written, `None` on overflow.
    pub(crate) fn finish(mut self) -> Option<usize> {
        if self.n > 0 {
            self.emit(low_u8(self.acc));
        }
        if self.overflow { None } else { Some(self.pos) }
    }
}

/// LSB-first bit reader. Reading past the end yields zero bits and is detected by
/// [`BitReader::overrun`].
#[cfg(feature = "std")]
pub(crate) struct BitReader<'a> {
    data: &'a [u8],
    /// Next byte to load (may run past `data.len()`: virtual zero bytes).
    pos: usize,
    acc: u64,
    n: u32,
}

#[cfg(feature = "std")]
impl<'a> BitReader<'a> {
    pub(crate) fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pos: 0,
            acc: 0,
            n: 0,
        }
    }

    /// Ensures at least 56 bits are buffered. (`n` is at most 63 while whole words are left:
    /// only the byte-wise tail below takes it to 64.)
    #[inline]
    pub(crate) fn refill(&mut self) {
        if let Some(chunk) = self.data.get(self.pos..self.pos + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let word = u64::from_le_bytes(word);
            // `take` (≤ 7) whole bytes fit above the `n` buffered bits.
            let take = (63 - self.n) >> 3;
            let mask = (1u64 << (take * 8)) - 1;
            self.acc |= (word & mask) << self.n;
            self.n += take * 8;
            self.pos += take as usize;
        } else {
            while self.n <= 56 {
                let b = self.data.get(self.pos).copied().unwrap_or(0);
                self.acc |= u64::from(b) << self.n;
                self.n += 8;
                self.pos += 1;
            }
        }
    }

    /// Reads `bits` ≤ 32 bits.
    #[inline(always)]
    pub(crate) fn get(&mut self, bits: u32) -> u64 {
        debug_assert!(bits <= 32);
        if self.n < bits {
            self.refill();
        }
        let v = self.acc & ((1u64 << bits) - 1);
        self.acc >>= bits;
        self.n -= bits;
        v
    }

    /// Reads `bits` ≤ 64 bits.
    #[inline(always)]
    pub(crate) fn get64(&mut self, bits: u32) -> u64 {
        if bits > 32 {
            let lo = self.get(32);
            lo | (self.get(bits - 32) << 32)
        } else {
            self.get(bits)
        }
    }

    #[inline(always)]
    pub(crate) fn bit(&mut self) -> bool {
        self.get(1) != 0
    }

    /// Inverse of [`BitWriter::rice`].
    #[inline(always)]
    pub(crate) fn rice(&mut self, k: u32) -> Result<u64, Malformed> {
        if self.n < 16 {
            self.refill();
        }
        let ones = self.acc.trailing_ones();
        if u64::from(ones) < RICE_ESCAPE {
            self.acc >>= ones + 1;
            self.n -= ones + 1;
            let q = u64::from(ones);
            let low = self.get64(k);
            Ok((q << k) | low)
        } else {
            self.acc >>= RICE_ESCAPE;
            self.n -= low_u32(RICE_ESCAPE);
            let n = low_u32(self.get(RICE_LEN_BITS)) + k + 2;
            if n > 64 {
                return Err(Malformed);
            }
            Ok((1u64 << (n - 1)) | self.get64(n - 1))
        }
    }

    /// A Rice code when `present`, otherwise nothing read and 0: for a field whose presence
    /// the data decides (a bit before it), read without a branch on that bit. The code and an
    /// escape are both read from the buffered bits and one chosen without a branch too; an
    /// escape longer than what is buffered, or malformed, takes [`BitReader::rice`].
    #[inline(always)]
    pub(crate) fn rice_if(&mut self, present: bool, k: u32) -> Result<u64, Malformed> {
        if self.n < 16 {
            self.refill();
        }
        let acc = self.acc;
        let ones = acc.trailing_ones();
        let escape = u64::from(ones) >= RICE_ESCAPE;
        // An escape's value has `n1 + 1` bits, its top bit implicit.
        let n1 = low_u32((acc >> RICE_ESCAPE) & ((1 << RICE_LEN_BITS) - 1)) + k + 1;
        let (shift, width, top) = core::hint::select_unpredictable(
            escape,
            (
                low_u32(RICE_ESCAPE) + RICE_LEN_BITS,
                n1,
                1u64.wrapping_shl(n1),
            ),
            (ones + 1, k, u64::from(ones).wrapping_shl(k)),
        );
        let total = shift + width;
        if width > 63 || total > self.n.min(63) {
            return if present { self.rice(k) } else { Ok(0) };
        }
        let v = top | ((acc >> shift) & ((1u64 << width) - 1));
        let used = core::hint::select_unpredictable(present, total, 0);
        self.acc = acc >> used;
        self.n -= used;
        Ok(v)
    }

    /// Inverse of [`BitWriter::small_rice`], for quotients below `max_q` (≤ 32): a quotient
    /// and its end take at most `max_q` bits, so more than that must be buffered.
    #[inline]
    pub(crate) fn small_rice(&mut self, k: u32, max_q: u32) -> Result<u64, Malformed> {
        if self.n <= max_q {
            self.refill();
        }
        let q = self.acc.trailing_ones();
        if q >= max_q {
            return Err(Malformed);
        }
        self.acc >>= q + 1;
        self.n -= q + 1;
        Ok((u64::from(q) << k) | self.get(k))
    }

    /// Inverse of [`BitWriter::lp`]; rejects lengths above `max_bits`.
    #[inline]
    pub(crate) fn lp(&mut self, len_bits: u32, max_bits: u32) -> Result<u64, Malformed> {
        let n = low_u32(self.get(len_bits));
        if n > max_bits {
            return Err(Malformed);
        }
        Ok(self.get64(n))
    }

    /// Bits consumed so far.
    pub(crate) fn consumed_bits(&self) -> usize {
        self.pos * 8 - self.n as usize
    }

    /// Whether more bits were consumed than the data holds.
    pub(crate) fn overrun(&self) -> bool {
        self.consumed_bits() > self.data.len() * 8
    }
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;

    #[test]
    fn zigzag_round_trips() {
        for v in [0i64, 1, -1, 2, -2, i64::MAX, i64::MIN, 12345, -98765] {
            assert_eq!(unzigzag(zigzag(v)), v);
        }
        assert_eq!(zigzag(0), 0);
        assert_eq!(zigzag(-1), 1);
        assert_eq!(zigzag(1), 2);
        assert_eq!(zigzag(i64::MIN), u64::MAX);
    }

    proptest::proptest! {
        /// `rice_if` reads what `rice` reads when the code is there (escapes and codes longer
        /// than the buffer included) and nothing when it is not.
        #[test]
        fn rice_if_reads_what_rice_reads(
            codes in proptest::collection::vec(
                (0u32..5, proptest::prelude::any::<u64>(), 0u32..64, proptest::prelude::any::<bool>()),
                1..40,
            )
        ) {
            // The parameter a few bits below the value's length: quotients 0 to 15, codes and
            // escapes both.
            let codes: Vec<(u32, u64, u32, bool)> = codes
                .into_iter()
                .map(|(below, v, shift, present)| {
                    (bit_len(v >> shift).saturating_sub(below).min(63), v, shift, present)
                })
                .collect();
            let mut buf = [0u8; 4096];
            let mut w = BitWriter::new(&mut buf);
            for &(k, v, shift, present) in &codes {
                if present {
                    w.rice(k, v >> shift);
                }
                w.bit(present);
            }
            let len = w.finish().unwrap();
            let mut r = BitReader::new(&buf[..len]);
            for &(k, v, shift, present) in &codes {
                let got = r.rice_if(present, k).unwrap();
                if present {
                    proptest::prop_assert_eq!(got, v >> shift);
                }
                proptest::prop_assert_eq!(r.bit(), present);
            }
            proptest::prop_assert!(!r.overrun());
        }
    }

    #[test]
    fn bits_round_trip() {
        let mut buf = [0u8; 4096];
        let values: [u64; 14] = [
            0,
            1,
            2,
            15,
            16,
            255,
            1 << 20,
            u64::MAX,
            u64::MAX - 1,
            3,
            1 << 63,
            77,
            3 << 62,
            (3 << 61) - 1,
        ];
        let mut w = BitWriter::new(&mut buf);
        let mut bits = 0;
        for k in [0u32, 1, 5, 13, 31, 32, 61, 62, 63] {
            for &v in &values {
                w.rice(k, v);
                bits += rice_bits(k, v);
                w.lp(v, 7);
                bits += 7 + bit_len(v);
                w.put(v, 64);
                bits += 64;
                w.bit(v & 1 == 1);
                bits += 1;
            }
        }
        let len = w.finish().unwrap();
        assert_eq!(len, (bits as usize).div_ceil(8));
        let mut r = BitReader::new(&buf[..len]);
        for k in [0u32, 1, 5, 13, 31, 32, 61, 62, 63] {
            for &v in &values {
                assert_eq!(r.rice(k).unwrap(), v, "rice k={k}");
                assert_eq!(r.lp(7, 64).unwrap(), v);
                assert_eq!(r.get64(64), v);
                assert_eq!(r.bit(), v & 1 == 1);
            }
        }
        assert!(!r.overrun());
        assert_eq!(r.consumed_bits(), bits as usize);
        r.get(8);
        assert!(r.overrun());
    }

    #[test]
    fn varints_round_trip_and_reject_overlong() {
        let mut buf = [0u8; 64];
        let mut w = ByteWriter::new(&mut buf);
        for v in [0, 127, 128, 300, u64::MAX] {
            w.varint(v);
        }
        let n = w.pos();
        let mut r = ByteReader::new(&buf[..n]);
        for v in [0, 127, 128, 300, u64::MAX] {
            assert_eq!(r.varint().unwrap(), v);
        }
        assert!(ByteReader::new(&[0xff; 11]).varint().is_err());
        assert!(
            ByteReader::new(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02])
                .varint()
                .is_err()
        );
        assert!(ByteReader::new(&[0x80]).varint().is_err());
    }
}
