//! Payload bytes to a JSON document.
//!
//! The size limit is checked before parsing, so an oversized payload costs no memory beyond its bytes. Nesting is
//! bounded by serde_json's recursion limit (128 levels): a deeper document is an error, never a stack overflow.
//! Numbers are kept as their exact text (serde_json's `arbitrary_precision`), so `9007199254740993` and
//! `100.000000000000000001` are never rounded through a float.

use serde::Deserialize;
use serde_json::Value;

/// How a pipeline's payloads are encoded. One format today; the enum is closed on purpose.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// UTF-8 JSON (RFC 8259), one document per record.
    #[default]
    Json,
}

/// Why a payload could not be decoded. Each sends the record to the dead letters.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The payload is larger than the pipeline's `max_payload_bytes`.
    #[error("payload of {size} bytes exceeds max_payload_bytes = {limit}")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// The configured limit in bytes.
        limit: usize,
    },
    /// Not a JSON document (including an empty payload, invalid UTF-8, a lone surrogate escape, or nesting deeper
    /// than 128 levels).
    #[error("payload is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Decodes payloads of one pipeline.
#[derive(Clone, Debug)]
pub struct Decoder {
    format: Format,
    max_payload_bytes: usize,
}

impl Decoder {
    /// A decoder for `format` that rejects payloads over `max_payload_bytes` bytes before parsing.
    pub fn new(format: Format, max_payload_bytes: usize) -> Self {
        Decoder { format, max_payload_bytes }
    }

    /// The largest payload decoded, in bytes.
    pub fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Decodes one non-null payload.
    pub fn decode(&self, payload: &[u8]) -> Result<Value, DecodeError> {
        if payload.len() > self.max_payload_bytes {
            return Err(DecodeError::TooLarge { size: payload.len(), limit: self.max_payload_bytes });
        }
        match self.format {
            Format::Json => Ok(serde_json::from_slice(payload)?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_oversized_before_parsing_and_deep_nesting_without_crashing() {
        let d = Decoder::new(Format::Json, 16);
        assert!(matches!(d.decode(&[b' '; 17]), Err(DecodeError::TooLarge { size: 17, limit: 16 })));
        let d = Decoder::new(Format::Json, 1 << 20);
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        assert!(matches!(d.decode(deep.as_bytes()), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(b""), Err(DecodeError::Json(_))));
        assert!(matches!(d.decode(br#"{"a":"\ud800"}"#), Err(DecodeError::Json(_))));
        assert!(d.decode(br#"{"a":1}"#).is_ok());
    }
}
