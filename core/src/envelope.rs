//! What the core stores in a commitlog record's properties: the exchange and routing key
//! a message was published with, then its [`Properties`] in their stored encoding.
//!
//! ```text
//! varint length + exchange, varint length + routing key, Properties::encode
//! ```

use std::sync::Arc;

use crate::encoding::{put_bytes, Reader};
use crate::error::CoreError;
use crate::message::Properties;

/// Encodes the stored envelope.
pub fn encode(exchange: &str, routing_key: &str, props: &Properties) -> Result<Vec<u8>, CoreError> {
    let mut out = Vec::with_capacity(32 + exchange.len() + routing_key.len());
    put_bytes(&mut out, exchange.as_bytes());
    put_bytes(&mut out, routing_key.as_bytes());
    props.encode(&mut out)?;
    Ok(out)
}

/// Decodes what [`encode`] wrote.
pub fn decode(bytes: &[u8]) -> Result<(String, String, Properties), CoreError> {
    let mut r = Reader::new(bytes);
    let exchange = r.string()?;
    let routing_key = r.string()?;
    let rest = r.take(r.remaining())?;
    Ok((exchange, routing_key, Properties::decode(rest)?))
}

/// [`decode`] into shared strings, as deliveries carry them.
pub(crate) fn decode_shared(bytes: &[u8]) -> Result<(Arc<str>, Arc<str>, Properties), CoreError> {
    let mut r = Reader::new(bytes);
    let exchange = shared_str(r.bytes()?)?;
    let routing_key = shared_str(r.bytes()?)?;
    let rest = r.take(r.remaining())?;
    Ok((exchange, routing_key, Properties::decode(rest)?))
}

fn shared_str(b: &[u8]) -> Result<Arc<str>, CoreError> {
    std::str::from_utf8(b)
        .map(Arc::from)
        .map_err(|_| CoreError::InvalidEncoding("string is not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let p = Properties {
            content_type: Some("text/plain".into()),
            delivery_mode: Some(2),
            ..Default::default()
        };
        let b = encode("amq.topic", "a.b", &p).unwrap();
        assert_eq!(
            decode(&b).unwrap(),
            ("amq.topic".into(), "a.b".into(), p.clone())
        );
        assert_eq!(
            decode_shared(&b).unwrap(),
            ("amq.topic".into(), "a.b".into(), p)
        );
        for i in 0..b.len() {
            let _ = decode(&b[..i]);
        }
        assert!(decode(&[0xff; 16]).is_err());
    }
}
