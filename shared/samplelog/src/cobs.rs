//! Consistent Overhead Byte Stuffing (Cheshire & Baker, 1999).
//!
//! The input is split at every 0x00 and after every run of 254 non-zero bytes; each group is sent
//! as a code byte (group length + 1: 0x01..=0xFF) followed by its non-zero bytes. A group with
//! code < 0xFF stands for its bytes followed by a 0x00, except the last group of the frame (whose
//! 0x00 is the conceptual terminator); a group with code 0xFF has no 0x00 after it. An input that
//! ends exactly after a 254-byte run therefore ends with an empty group, code 0x01. The output has
//! no 0x00 and is at most `len + 1 + len / 254` bytes long.

/// Largest encoded length of `len` input bytes.
#[must_use]
pub const fn max_encoded_len(len: usize) -> usize {
    len + 1 + len / 254
}

/// Encodes `buf[src..src + len]` into `buf[dst..]`, in place, and returns the encoded length.
///
/// Requires `dst + 1 + len / 254 <= src`: every output byte then lands at or before the input byte
/// it comes from, so no input byte is overwritten before it is read.
pub(crate) fn encode_in_place(buf: &mut [u8], dst: usize, src: usize, len: usize) -> usize {
    debug_assert!(dst + 1 + len / 254 <= src);
    let mut code_pos = dst;
    let mut w = dst + 1;
    let mut code: u8 = 1;
    for i in src..src + len {
        let b = buf[i];
        if b == 0 {
            buf[code_pos] = code;
            code_pos = w;
            w += 1;
            code = 1;
        } else {
            buf[w] = b;
            w += 1;
            code += 1;
            if code == 0xFF {
                buf[code_pos] = code;
                code_pos = w;
                w += 1;
                code = 1;
            }
        }
    }
    buf[code_pos] = code;
    w - dst
}

/// Encoded length of `data` (what [`encode_in_place`] returns for it).
#[cfg(feature = "std")]
pub(crate) fn encoded_len(data: &[u8]) -> usize {
    let mut n = 1;
    let mut run = 0;
    for &b in data {
        if b == 0 {
            n += 1;
            run = 0;
        } else {
            n += 1;
            run += 1;
            if run == 254 {
                n += 1;
                run = 0;
            }
        }
    }
    n
}

/// Room [`decode`] keeps in its buffer past the decoded bytes: it copies a group in 32-byte
/// pieces.
#[cfg(feature = "std")]
const COPY_SLACK: usize = 32;

/// Decodes `span` (bytes between two 0x00 delimiters) into the start of `buf` (grown as needed,
/// never shrunk: what lies past the decoded bytes is left over from before). Returns the decoded
/// length and whether `span` was a complete COBS encoding. Lenient: on a group that runs past the
/// end of `span` (or a stray 0x00 code) it keeps what there is and says `false`.
///
/// A group's bytes are copied in 32-byte pieces where `span` has them to spare, which the
/// compiler writes out as a few vector moves: the frames' groups average some 55 bytes, and a
/// `memcpy` call for each took 4 % of a capture's decoding.
#[cfg(feature = "std")]
pub(crate) fn decode(span: &[u8], buf: &mut Vec<u8>) -> (usize, bool) {
    // The output never runs ahead of the input (a group of `code` bytes gives at most `code`),
    // so a piece written at `o + k < span.len()` ends within `span.len() + COPY_SLACK`.
    if buf.len() < span.len() + COPY_SLACK {
        buf.resize(span.len() + COPY_SLACK, 0);
    }
    let mut i = 0;
    let mut o = 0;
    while i < span.len() {
        let code = usize::from(span[i]);
        if code == 0 {
            return (o, false);
        }
        let start = i + 1;
        let end = i + code;
        if end > span.len() {
            let rest = &span[start..];
            buf[o..o + rest.len()].copy_from_slice(rest);
            return (o + rest.len(), false);
        }
        let n = code - 1;
        if end + COPY_SLACK <= span.len() {
            let mut k = 0;
            while k < n {
                buf[o + k..o + k + COPY_SLACK]
                    .copy_from_slice(&span[start + k..start + k + COPY_SLACK]);
                k += COPY_SLACK;
            }
        } else {
            buf[o..o + n].copy_from_slice(&span[start..end]);
        }
        o += n;
        i = end;
        if code < 0xFF && i < span.len() {
            buf[o] = 0;
            o += 1;
        }
    }
    (o, true)
}

#[cfg(all(test, feature = "std"))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(data: &[u8]) -> Vec<u8> {
        let slack = 1 + data.len() / 254;
        let mut buf = vec![0u8; slack + data.len()];
        buf[slack..].copy_from_slice(data);
        let n = encode_in_place(&mut buf, 0, slack, data.len());
        buf.truncate(n);
        buf
    }

    #[test]
    fn known_vectors() {
        // From the COBS paper / Wikipedia.
        assert_eq!(encode(&[]), [0x01]);
        assert_eq!(encode(&[0]), [0x01, 0x01]);
        assert_eq!(encode(&[0, 0]), [0x01, 0x01, 0x01]);
        assert_eq!(
            encode(&[0x11, 0x22, 0x00, 0x33]),
            [0x03, 0x11, 0x22, 0x02, 0x33]
        );
        assert_eq!(
            encode(&[0x11, 0x00, 0x00, 0x00]),
            [0x02, 0x11, 0x01, 0x01, 0x01]
        );
        let run: Vec<u8> = (1..=254).collect();
        let mut want = vec![0xFF];
        want.extend(&run);
        want.push(0x01);
        assert_eq!(encode(&run), want);
        let mut run255 = run.clone();
        run255.push(0xFF);
        let mut want = vec![0xFF];
        want.extend(&run);
        want.extend([0x02, 0xFF]);
        assert_eq!(encode(&run255), want);
    }

    proptest! {
        #[test]
        fn round_trip(data in prop::collection::vec(prop_oneof![Just(0u8), any::<u8>()], 0..2000)) {
            let enc = encode(&data);
            prop_assert!(!enc.contains(&0));
            prop_assert!(enc.len() <= max_encoded_len(data.len()));
            prop_assert_eq!(enc.len(), encoded_len(&data));
            let mut buf = Vec::new();
            let (len, complete) = decode(&enc, &mut buf);
            prop_assert!(complete);
            prop_assert_eq!(&buf[..len], &data[..]);
        }

        /// Any span, COBS or not, decodes as a group-by-group reading of it says, into a buffer
        /// that held anything before.
        #[test]
        fn any_span_decodes_as_read_group_by_group(
            span in prop::collection::vec(prop_oneof![Just(0u8), 1u8..8, any::<u8>(), Just(0xFF)], 0..1200),
            before in prop::collection::vec(any::<u8>(), 0..1500),
        ) {
            let mut buf = before;
            let (len, complete) = decode(&span, &mut buf);
            let (want, want_complete) = read_groups(&span);
            prop_assert_eq!(&buf[..len], &want[..]);
            prop_assert_eq!(complete, want_complete);
        }
    }

    /// The decoding, one group after another by the definition: `code - 1` bytes, then a 0x00
    /// unless the code is 0xFF or the span ends.
    fn read_groups(span: &[u8]) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        let mut i = 0;
        while i < span.len() {
            let code = usize::from(span[i]);
            if code == 0 {
                return (out, false);
            }
            if i + code > span.len() {
                out.extend_from_slice(&span[i + 1..]);
                return (out, false);
            }
            out.extend_from_slice(&span[i + 1..i + code]);
            i += code;
            if code < 0xFF && i < span.len() {
                out.push(0);
            }
        }
        (out, true)
    }
}
