//! The live commands over a stream as it arrives: where the bytes come from ([`source`]),
//! `record` writing them to a capture, `top` drawing the last seconds, and the counts both keep
//! ([`window`]). They use `naming` (and may use `model`), never `views`.

pub mod record;
pub mod source;
pub mod top;
pub mod window;
