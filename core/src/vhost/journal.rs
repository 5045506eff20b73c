//! How a vhost's topology is kept in the metadata journal: the keys of exchanges,
//! queues and bindings, their documents, and the import of the one document an earlier
//! version kept.

use super::*;

/// A vhost's topology as an earlier version kept it: one document rewritten on every
/// change. Read once at start, moved into the journal, then removed.
#[derive(Serialize, Deserialize, Default)]
pub(super) struct VhostDoc {
    pub(super) exchanges: Vec<ExchangeDoc>,
    pub(super) queues: Vec<QueueDoc>,
    pub(super) bindings: Vec<BindingDoc>,
}

#[derive(Serialize, Deserialize)]
pub(super) struct ExchangeDoc {
    pub(super) name: String,
    pub(super) kind: String,
    pub(super) auto_delete: bool,
    pub(super) internal: bool,
    pub(super) arguments: String,
}

#[derive(Serialize, Deserialize)]
pub(super) struct QueueDoc {
    pub(super) name: String,
    pub(super) auto_delete: bool,
    pub(super) arguments: String,
}

#[derive(Serialize, Deserialize)]
pub(super) struct BindingDoc {
    pub(super) source: String,
    pub(super) destination: String,
    pub(super) to_exchange: bool,
    pub(super) key: String,
    pub(super) arguments: String,
}

pub(super) fn table_to_hex(t: &FieldTable) -> String {
    let mut b = Vec::new();
    if put_table(&mut b, t, 0).is_err() {
        return String::new();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(super) fn table_from_hex(s: &str) -> Result<FieldTable, CoreError> {
    if s.is_empty() {
        return Ok(FieldTable::default());
    }
    let bytes: Option<Vec<u8>> = (0..s.len())
        .step_by(2)
        .map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok()))
        .collect();
    let bytes = bytes.ok_or(CoreError::InvalidEncoding("bad hex in a stored table"))?;
    Reader::new(&bytes).table(0)
}

/// The metadata document name of a vhost (earlier versions).
pub(crate) fn doc_name(vhost: &str) -> String {
    let hex: String = vhost.bytes().map(|b| format!("{b:02x}")).collect();
    format!("vhost-{hex}")
}

pub(super) const TAG_EXCHANGE: u8 = b'X';
pub(super) const TAG_QUEUE: u8 = b'q';
pub(super) const TAG_BINDING: u8 = b'B';

pub(super) fn exchange_key(vhost: &str, name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_EXCHANGE)
        .part(vhost.as_bytes())
        .part(name.as_bytes())
        .build()
}

pub(super) fn queue_key(vhost: &str, name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_QUEUE)
        .part(vhost.as_bytes())
        .part(name.as_bytes())
        .build()
}

/// The prefix of every binding leading to `dest`.
pub(super) fn bindings_to_prefix(vhost: &str, dest: &Destination) -> KeyBuilder {
    let (kind, name): (&[u8], &str) = match dest {
        Destination::Queue(q) => (b"q", q),
        Destination::Exchange(x) => (b"x", x),
    };
    KeyBuilder::new(TAG_BINDING)
        .part(vhost.as_bytes())
        .part(kind)
        .part(name.as_bytes())
}

pub(super) fn binding_key(
    vhost: &str,
    source: &str,
    dest: &Destination,
    key: &str,
    args: &FieldTable,
) -> Vec<u8> {
    let mut a = Vec::new();
    if put_table(&mut a, args, 0).is_err() {
        a.clear();
    }
    bindings_to_prefix(vhost, dest)
        .part(source.as_bytes())
        .part(key.as_bytes())
        .part(&a)
        .build()
}

/// Journal operations for exchanges a deletion cascaded to: each one's record and the
/// bindings leading to it (auto-delete exchanges are deleted once they have no bindings
/// of their own left, so none start from them).
pub(super) fn deleted_exchange_ops(vhost: &str, deleted: &[String], ops: &mut Vec<MetaOp>) {
    for x in deleted {
        ops.push(MetaOp::delete(exchange_key(vhost, x)));
        ops.push(MetaOp::delete_prefix(
            bindings_to_prefix(vhost, &Destination::exchange(x.clone())).build(),
        ));
    }
}

pub(super) fn to_json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

pub(super) fn from_json<T: serde::de::DeserializeOwned>(v: &[u8]) -> Result<T, CoreError> {
    serde_json::from_slice(v).map_err(|_| CoreError::InvalidEncoding("bad stored topology record"))
}

/// Moves an earlier version's topology document of `vhost` into the journal.
pub(super) fn import_legacy_doc(store: &Store, vhost: &str) -> Result<(), CoreError> {
    let Some(doc) = store.meta().get::<VhostDoc>(&doc_name(vhost))? else {
        return Ok(());
    };
    let mut ops = Vec::new();
    for x in &doc.exchanges {
        ops.push(MetaOp::put(exchange_key(vhost, &x.name), to_json(x)));
    }
    for q in &doc.queues {
        ops.push(MetaOp::put(queue_key(vhost, &q.name), to_json(q)));
    }
    for b in &doc.bindings {
        let dest = if b.to_exchange {
            Destination::exchange(b.destination.clone())
        } else {
            Destination::queue(b.destination.clone())
        };
        let args = table_from_hex(&b.arguments)?;
        ops.push(MetaOp::put(
            binding_key(vhost, &b.source, &dest, &b.key, &args),
            Vec::new(),
        ));
    }
    store.journal().commit(ops)?;
    store.meta().delete(&doc_name(vhost))?;
    tracing::info!(
        vhost,
        "moved the vhost's topology document into the metadata journal"
    );
    Ok(())
}
