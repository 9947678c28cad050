//! The Confluent wire format: a magic byte `0`, the schema id as a 4-byte big-endian integer, then the encoded
//! value (for Protobuf, the message indexes come first). The format the Confluent serializers, Kafka Connect's
//! converters, Debezium, Redpanda and the other registries' serdes write
//! (<https://docs.confluent.io/platform/current/schema-registry/fundamentals/serdes-develop/index.html#wire-format>).

/// The first byte of a wire-format payload.
pub const MAGIC: u8 = 0;

/// Why a payload is not in the wire format.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    /// Fewer than the 5 bytes of the header.
    #[error("not in the schema registry wire format: {0} bytes, shorter than the 5-byte header (magic byte 0, schema id)")]
    Short(usize),
    /// The first byte is not 0.
    #[error("not in the schema registry wire format: the first byte is {0:#04x}, not the magic byte 0x00")]
    Magic(u8),
}

/// The schema id and the encoded value of a wire-format `payload`.
///
/// Errors: the payload is shorter than the header, or does not start with the magic byte.
pub fn split(payload: &[u8]) -> Result<(u32, &[u8]), WireError> {
    match payload {
        [MAGIC, a, b, c, d, rest @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        [first, ..] if *first != MAGIC => Err(WireError::Magic(*first)),
        _ => Err(WireError::Short(payload.len())),
    }
}

/// The schema id of a wire-format `payload`, if it is one.
pub fn schema_id(payload: &[u8]) -> Option<u32> {
    split(payload).ok().map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header() {
        assert_eq!(split(&[0, 0, 0, 1, 2, 9]), Ok((258, &[9u8][..])));
        assert_eq!(split(&[0, 0, 0, 0, 7]), Ok((7, &[][..])));
        assert_eq!(split(b"{\"a\":1}"), Err(WireError::Magic(b'{')));
        assert_eq!(split(&[0, 1]), Err(WireError::Short(2)));
        assert_eq!(split(&[]), Err(WireError::Short(0)));
    }
}
