//! What the core stores in a commitlog record's properties: the exchange and routing key
//! a message was published with, then its [`Properties`] in their stored encoding.
//!
//! ```text
//! varint length + exchange, varint length + routing key, Properties::encode
//! ```

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
        assert_eq!(decode(&b).unwrap(), ("amq.topic".into(), "a.b".into(), p));
        for i in 0..b.len() {
            let _ = decode(&b[..i]);
        }
        assert!(decode(&[0xff; 16]).is_err());
    }
}
