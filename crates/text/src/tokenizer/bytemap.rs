//! GPT-2's byte-to-unicode mapping.
//!
//! Byte-level BPE vocabularies write every byte as a printable character (space becomes
//! `Ġ`, newline `Ċ`) so that token strings survive JSON and text tools. We undo the
//! mapping once at load time; everything after that works on raw bytes.

/// Bytes GPT-2 keeps as their own character.
const fn is_printable(b: u8) -> bool {
    matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The 68 bytes that GPT-2 moves to U+0100 onwards, in order.
const SHIFTED: [u8; 68] = {
    let mut table = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !is_printable(b as u8) {
            table[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    table
};

/// The byte a mapped character stands for, if it is one of the 256 mapped characters.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let c = u32::from(c);
    match u8::try_from(c) {
        Ok(b) => is_printable(b).then_some(b),
        Err(_) => SHIFTED.get(usize::try_from(c.checked_sub(256)?).ok()?).copied(),
    }
}

/// The character GPT-2 writes for `b` (the inverse of [`char_to_byte`]).
#[cfg(test)]
pub(crate) fn byte_to_char(b: u8) -> char {
    if is_printable(b) {
        return char::from(b);
    }
    let pos = SHIFTED.iter().position(|&s| s == b).unwrap_or(0);
    char::from_u32(256 + pos as u32).unwrap_or('?')
}

/// Raw bytes of a token string in the mapped form. Characters outside the mapping keep
/// their UTF-8 bytes: some converters store added tokens as plain text.
pub(crate) fn unmap(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    for c in s.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0u8; 4]).as_bytes()),
        }
    }
    out
}

/// The mapped form of raw bytes, as vocabularies store it.
#[cfg(test)]
pub(crate) fn map(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| byte_to_char(b)).collect()
}
