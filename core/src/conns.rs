//! The connection registry: what the management API lists as `/api/connections` and
//! how it closes one, and what the connection's one INFO log line (at its close) says.
//!
//! The shell registers every client connection (AMQP, STOMP, MQTT, over TCP, TLS or
//! WebSocket) as it accepts it, and holds the returned [`Registration`] for the
//! connection's life; dropping it unregisters. The connection's task runs inside
//! [`Registration::scope`], so that the broker fills in what only the login knows
//! (user, vhost, the core's [`ConnectionId`]) from the calls every adapter already makes
//! ([`crate::Broker::vhost_access`], [`crate::Broker::connection_slot`],
//! [`crate::Broker::next_connection_id`]) without the adapters knowing of it; MQTT adds
//! its client id with [`note_client`].
//!
//! Cost per connection: one [`ConnInfo`] allocation (about 180 bytes, plus 40 for
//! its byte counters, [`IoCounts`], and their rate sample's box), one more for the
//! user, vhost and client id once logged in, one map slot, and the connection's own
//! shutdown token (a child of the broker's, about 100 bytes); register and unregister
//! are O(1) under one short lock. Measured with `triad-bench mqtt-idle` (15,000
//! connections): see BENCHMARKS.md. Listing copies the map's `Arc`s (O(connections)),
//! never on a hot path.
//!
//! AMQP channels register too ([`open_channel`], from the connection's task): one
//! [`ChannelStats`] of about 40 bytes per open channel in a list on the connection's
//! entry (a `Vec` of 24 bytes while empty), which the channel's owner updates with
//! relaxed stores; `/api/channels` reads them.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use tokio_util::sync::CancellationToken;

use crate::ConnectionId;

tokio::task_local! {
    static CURRENT: Arc<ConnInfo>;
}

/// What the login of a connection established.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Login {
    /// The authenticated user.
    pub user: String,
    /// The vhost opened, once known.
    pub vhost: Option<String>,
    /// MQTT's client id, once known.
    pub client: Option<String>,
}

/// What is noted of a connection after it was accepted, in one allocation: the user,
/// the vhost, MQTT's client id and the client certificate's CN, one after the other;
/// `ends` are where the first three end, and `present` has bit `i` set for each part
/// noted (a part not noted has no bytes).
#[derive(Default)]
struct Held {
    text: Box<str>,
    ends: [u32; 3],
    present: u8,
}

const USER: usize = 0;
const CLIENT: usize = 2;
const CERT_CN: usize = 3;

impl Held {
    fn new(parts: [Option<&str>; 4]) -> Held {
        let mut text = String::with_capacity(parts.iter().flatten().map(|p| p.len()).sum());
        let mut ends = [0u32; 3];
        let mut present = 0u8;
        for (i, p) in parts.iter().enumerate() {
            if let Some(p) = p {
                text.push_str(p);
                present |= 1 << i;
            }
            if let Some(end) = ends.get_mut(i) {
                *end = u32::try_from(text.len()).unwrap_or(u32::MAX);
            }
        }
        Held {
            text: text.into_boxed_str(),
            ends,
            present,
        }
    }

    /// User, vhost, client id and certificate CN, each as noted.
    fn parts(&self) -> [Option<&str>; 4] {
        let bound = |i: usize| match i {
            0 => 0,
            4 => self.text.len(),
            i => self.ends.get(i - 1).map_or(0, |&e| e as usize),
        };
        std::array::from_fn(|i| {
            (self.present & (1 << i) != 0)
                .then(|| self.text.get(bound(i)..bound(i + 1)).unwrap_or(""))
        })
    }

    /// The same with part `i` replaced.
    fn with(&self, i: usize, part: Option<&str>) -> Held {
        let mut parts = self.parts();
        if let Some(slot) = parts.get_mut(i) {
            *slot = part;
        }
        Held::new(parts)
    }
}

/// One open connection.
pub struct ConnInfo {
    /// Registry id (the management API's connection name is built from it and the
    /// peer).
    pub id: u64,
    /// `amqp`, `stomp` or `mqtt`.
    pub protocol: &'static str,
    /// Over TLS.
    pub tls: bool,
    /// Through the HTTP listener's WebSocket endpoints.
    pub websocket: bool,
    /// The client's address.
    pub peer: SocketAddr,
    /// The balancer's address, for a connection behind a PROXY protocol header.
    via: Option<Box<SocketAddr>>,
    /// Unix time of the connection, ms.
    pub connected_at: u64,
    login: Mutex<Held>,
    core_id: OnceLock<ConnectionId>,
    /// The connection's own shutdown token: cancelling it closes the connection.
    close: CancellationToken,
    /// Its open AMQP channels (empty for STOMP and MQTT), at most the connection's
    /// `channel_max`: each a small shared entry the channel's owner updates.
    channels: Mutex<Vec<Arc<ChannelStats>>>,
    /// Bytes and reads / writes on its stream ([`IoCounts`]).
    io: IoCounts,
    /// The management API's last reading of `io`, once a listing asked (boxed: 8 bytes
    /// while nobody has).
    io_rate: Mutex<Option<Box<crate::stats::RateSample>>>,
}

/// RabbitMQ's `recv_oct`, `recv_cnt`, `send_oct` and `send_cnt` of a connection: bytes
/// and socket reads / writes. Each figure has one writer (the connection's reading or
/// writing side), which adds with a relaxed load and store (plain moves on common
/// CPUs: no lock, no read-modify-write) once per read or write call, not per message;
/// a listing reads them. 32 bytes per connection.
#[derive(Debug, Default)]
pub struct IoCounts {
    recv_oct: AtomicU64,
    recv_cnt: AtomicU64,
    send_oct: AtomicU64,
    send_cnt: AtomicU64,
}

/// A reading of [`IoCounts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoTotals {
    /// Bytes read.
    pub recv_oct: u64,
    /// Reads that returned bytes.
    pub recv_cnt: u64,
    /// Bytes written.
    pub send_oct: u64,
    /// Writes that took bytes.
    pub send_cnt: u64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// One open AMQP channel as `/api/channels` lists it: the channel's owner (the
/// connection's task) stores each figure as it changes, with relaxed atomic stores (a
/// plain store on common CPUs, no lock, no read-modify-write); a listing reads them.
/// About 40 bytes per channel.
#[derive(Debug, Default)]
pub struct ChannelStats {
    number: u16,
    mode: AtomicU8,
    prefetch: AtomicU32,
    global_prefetch: AtomicU32,
    consumers: AtomicU32,
    unacked: AtomicU64,
}

/// A channel's publishing mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChannelMode {
    /// Neither confirms nor transactions.
    Normal,
    /// `confirm.select` was sent.
    Confirm,
    /// `tx.select` was sent.
    Tx,
}

impl ChannelStats {
    /// The channel number.
    pub fn number(&self) -> u16 {
        self.number
    }

    /// Its mode.
    pub fn mode(&self) -> ChannelMode {
        match self.mode.load(Ordering::Relaxed) {
            1 => ChannelMode::Confirm,
            2 => ChannelMode::Tx,
            _ => ChannelMode::Normal,
        }
    }

    /// Notes its mode.
    pub fn set_mode(&self, m: ChannelMode) {
        let v = match m {
            ChannelMode::Normal => 0,
            ChannelMode::Confirm => 1,
            ChannelMode::Tx => 2,
        };
        self.mode.store(v, Ordering::Relaxed);
    }

    /// Per-consumer prefetch (`basic.qos` global=false) and the channel-wide one
    /// (global=true), 0 for none.
    pub fn prefetch(&self) -> (u32, u32) {
        (
            self.prefetch.load(Ordering::Relaxed),
            self.global_prefetch.load(Ordering::Relaxed),
        )
    }

    /// Notes a `basic.qos`.
    pub fn set_prefetch(&self, n: u32, global: bool) {
        let slot = if global {
            &self.global_prefetch
        } else {
            &self.prefetch
        };
        slot.store(n, Ordering::Relaxed);
    }

    /// Consumers on the channel.
    pub fn consumers(&self) -> u32 {
        self.consumers.load(Ordering::Relaxed)
    }

    /// Notes how many consumers the channel has.
    pub fn set_consumers(&self, n: usize) {
        self.consumers
            .store(u32::try_from(n).unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// Deliveries awaiting ack.
    pub fn unacked(&self) -> u64 {
        self.unacked.load(Ordering::Relaxed)
    }

    /// Notes how many deliveries await an ack.
    pub fn set_unacked(&self, n: usize) {
        self.unacked.store(n as u64, Ordering::Relaxed);
    }
}

/// An open AMQP channel's entry in its connection's registry entry; dropping it
/// removes the entry (O(channels of the connection), bounded by `channel_max`).
#[derive(Debug)]
pub struct ChannelEntry {
    conn: Arc<ConnInfo>,
    stats: Arc<ChannelStats>,
}

impl ChannelEntry {
    /// The figures the channel's owner keeps up to date.
    pub fn stats(&self) -> &ChannelStats {
        &self.stats
    }
}

impl Drop for ChannelEntry {
    fn drop(&mut self) {
        let mut chans = self.conn.channel_list();
        if let Some(i) = chans.iter().position(|c| Arc::ptr_eq(c, &self.stats)) {
            chans.swap_remove(i);
        }
    }
}

impl std::fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnInfo")
            .field("id", &self.id)
            .field("protocol", &self.protocol)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl ConnInfo {
    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.login.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The login, once it happened.
    pub fn login(&self) -> Option<Login> {
        let l = self.held();
        let [user, vhost, client, _] = l.parts();
        Some(Login {
            user: user?.to_owned(),
            vhost: vhost.map(str::to_owned),
            client: client.map(str::to_owned),
        })
    }

    /// Calls `f` with the user, vhost and client id noted so far, without copying them
    /// (the close log line).
    pub fn with_login<R>(
        &self,
        f: impl FnOnce(Option<&str>, Option<&str>, Option<&str>) -> R,
    ) -> R {
        let l = self.held();
        let [user, vhost, client, _] = l.parts();
        f(user, vhost, client)
    }

    /// Replaces part `i` of what is noted.
    fn note(&self, i: usize, part: Option<&str>) {
        let mut l = self.held();
        *l = l.with(i, part);
    }

    fn user_is(&self, user: &str) -> bool {
        self.held().parts()[USER] == Some(user)
    }

    /// The balancer's address, for a connection behind a PROXY protocol header.
    pub fn via(&self) -> Option<SocketAddr> {
        self.via.as_deref().copied()
    }

    /// The verified client certificate's subject CN, if any.
    pub fn peer_cert_cn(&self) -> Option<String> {
        self.held().parts()[CERT_CN].map(str::to_owned)
    }

    /// Notes the client certificate's CN (once the TLS handshake verified it).
    pub fn set_peer_cert_cn(&self, cn: &str) {
        self.note(CERT_CN, Some(cn));
    }

    /// The core's id of this connection (exclusive queues, consumers), once known.
    pub fn core_id(&self) -> Option<ConnectionId> {
        self.core_id.get().copied()
    }

    /// The connection's name: `peer (id)`, unique per connection (RabbitMQ's is
    /// `peer -> local`; the id keeps two connections from one address apart).
    pub fn name(&self) -> String {
        format!("{} ({})", self.peer, self.id)
    }

    fn channel_list(&self) -> std::sync::MutexGuard<'_, Vec<Arc<ChannelStats>>> {
        self.channels.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Notes `n` bytes read from the connection's stream in one read (only its
    /// reading side calls this).
    pub fn note_recv(&self, n: usize) {
        bump(&self.io.recv_oct, n as u64);
        bump(&self.io.recv_cnt, 1);
    }

    /// Notes `n` bytes written to the connection's stream in one write (only its
    /// writing side calls this).
    pub fn note_send(&self, n: usize) {
        bump(&self.io.send_oct, n as u64);
        bump(&self.io.send_cnt, 1);
    }

    /// Bytes, reads and writes so far.
    pub fn io(&self) -> IoTotals {
        IoTotals {
            recv_oct: self.io.recv_oct.load(Ordering::Relaxed),
            recv_cnt: self.io.recv_cnt.load(Ordering::Relaxed),
            send_oct: self.io.send_oct.load(Ordering::Relaxed),
            send_cnt: self.io.send_cnt.load(Ordering::Relaxed),
        }
    }

    /// [`ConnInfo::io`] and the per-second rates of `recv_oct` and `send_oct` since
    /// the previous reading (at least [`crate::stats::RATE_INTERVAL`] ago; 0 at the
    /// first), as RabbitMQ's `*_details.rate`.
    pub fn io_with_rates(&self) -> (IoTotals, [f64; 2]) {
        let t = self.io();
        let values = [t.recv_oct, t.send_oct, 0, 0, 0, 0, 0, 0];
        let now = std::time::Instant::now();
        let mut r = self.io_rate.lock().unwrap_or_else(|e| e.into_inner());
        let rates = match r.as_mut() {
            Some(s) => s.rates(values, now),
            None => {
                *r = Some(Box::new(crate::stats::RateSample::new(values, now)));
                [0.0; 8]
            }
        };
        (t, [rates[0], rates[1]])
    }

    /// How many AMQP channels it has open.
    pub fn channel_count(&self) -> usize {
        self.channel_list().len()
    }

    /// Its open AMQP channels, by number.
    pub fn channels(&self) -> Vec<Arc<ChannelStats>> {
        let mut v = self.channel_list().clone();
        v.sort_unstable_by_key(|c| c.number);
        v
    }

    /// Asks the connection to close (as at broker shutdown: AMQP `connection.close`,
    /// STOMP ERROR, MQTT close).
    pub fn close(&self) {
        self.close.cancel();
    }
}

/// What the shell knows of a connection when it registers it.
pub struct NewConn {
    /// `amqp`, `stomp` or `mqtt`.
    pub protocol: &'static str,
    /// Over TLS.
    pub tls: bool,
    /// Through a WebSocket.
    pub websocket: bool,
    /// The client's address.
    pub peer: SocketAddr,
    /// The balancer's address, behind a PROXY protocol header.
    pub via: Option<SocketAddr>,
    /// The connection's own shutdown token (cancelled to close it).
    pub close: CancellationToken,
}

/// Every open client connection.
#[derive(Debug, Default)]
pub struct Registry {
    map: Mutex<HashMap<u64, Arc<ConnInfo>>>,
    next: AtomicU64,
}

/// A registered connection; dropping it unregisters.
#[derive(Debug)]
pub struct Registration {
    info: Arc<ConnInfo>,
    registry: Weak<Registry>,
}

impl Registry {
    /// Registers a connection.
    pub fn register(self: &Arc<Self>, c: NewConn) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let info = Arc::new(ConnInfo {
            id,
            protocol: c.protocol,
            tls: c.tls,
            websocket: c.websocket,
            peer: c.peer,
            via: c.via.map(Box::new),
            connected_at: crate::queue::now_ms(),
            login: Mutex::new(Held::default()),
            core_id: OnceLock::new(),
            close: c.close,
            channels: Mutex::new(Vec::new()),
            io: IoCounts::default(),
            io_rate: Mutex::new(None),
        });
        self.lock().insert(id, Arc::clone(&info));
        Registration {
            info,
            registry: Arc::downgrade(self),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnInfo>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Open connections, in registration order.
    pub fn list(&self) -> Vec<Arc<ConnInfo>> {
        let mut v: Vec<_> = self.lock().values().cloned().collect();
        v.sort_unstable_by_key(|c| c.id);
        v
    }

    /// How many connections are open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A connection by [`ConnInfo::name`].
    pub fn by_name(&self, name: &str) -> Option<Arc<ConnInfo>> {
        // names end in " (id)": look the id up rather than format every name
        let id = name
            .strip_suffix(')')
            .and_then(|s| s.rsplit_once(" ("))
            .and_then(|(_, id)| id.parse::<u64>().ok())?;
        let c = self.lock().get(&id).cloned()?;
        (c.name() == name).then_some(c)
    }

    /// The connection the core knows as `core_id`.
    pub fn by_core_id(&self, core_id: ConnectionId) -> Option<Arc<ConnInfo>> {
        self.lock()
            .values()
            .find(|c| c.core_id() == Some(core_id))
            .cloned()
    }

    /// Closes every connection of `user` (the user was deleted, as RabbitMQ does).
    pub fn close_user(&self, user: &str) -> usize {
        let of_user: Vec<_> = self
            .lock()
            .values()
            .filter(|c| c.user_is(user))
            .cloned()
            .collect();
        for c in &of_user {
            c.close();
        }
        of_user.len()
    }
}

impl Registration {
    /// The registered connection.
    pub fn info(&self) -> &Arc<ConnInfo> {
        &self.info
    }

    /// Runs `fut` (the connection's task) with this connection as the current one, so
    /// the broker can note its login.
    pub fn scope<F: Future>(&self, fut: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(Arc::clone(&self.info), fut)
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(r) = self.registry.upgrade() {
            r.lock().remove(&self.info.id);
        }
    }
}

/// Notes the authenticated user of the current connection (if the caller runs in a
/// registered connection's scope).
pub(crate) fn note_user(user: &str) {
    let _ = CURRENT.try_with(|c| {
        if !c.user_is(user) {
            let mut l = c.held();
            let [_, _, client, cert] = l.parts();
            *l = Held::new([Some(user), None, client, cert]);
        }
    });
}

/// Notes the vhost the current connection opened.
pub(crate) fn note_vhost(user: &str, vhost: &str) {
    let _ = CURRENT.try_with(|c| {
        let mut l = c.held();
        let [_, _, client, cert] = l.parts();
        *l = Held::new([Some(user), Some(vhost), client, cert]);
    });
}

/// Notes MQTT's client id of the current connection (after its login).
pub fn note_client(client: &str) {
    let _ = CURRENT.try_with(|c| c.note(CLIENT, Some(client)));
}

/// Registers AMQP channel `number` of the current connection (`None` outside a
/// registered connection's scope); the channel keeps the entry for its life.
pub fn open_channel(number: u16) -> Option<ChannelEntry> {
    CURRENT
        .try_with(|c| {
            let stats = Arc::new(ChannelStats {
                number,
                ..ChannelStats::default()
            });
            c.channel_list().push(Arc::clone(&stats));
            ChannelEntry {
                conn: Arc::clone(c),
                stats,
            }
        })
        .ok()
}

/// Notes the core's id of the current connection (the first one it takes).
pub(crate) fn note_core_id(id: ConnectionId) {
    let _ = CURRENT.try_with(|c| c.core_id.set(id));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn new_conn(close: CancellationToken) -> NewConn {
        NewConn {
            protocol: "amqp",
            tls: false,
            websocket: false,
            peer: "127.0.0.1:5000".parse().unwrap(),
            via: None,
            close,
        }
    }

    #[tokio::test]
    async fn registers_notes_the_login_closes_and_unregisters() {
        let r = Arc::new(Registry::default());
        let token = CancellationToken::new();
        let reg = r.register(new_conn(token.clone()));
        assert_eq!(r.len(), 1);
        let name = reg.info().name();
        assert_eq!(name, "127.0.0.1:5000 (1)");
        reg.scope(async {
            note_core_id(7);
            note_core_id(8);
            note_user("alice");
            note_vhost("alice", "/");
            note_client("sensor-1");
        })
        .await;
        let c = r.by_name(&name).expect("found");
        assert_eq!(c.core_id(), Some(7));
        let login = c.login().expect("login");
        assert_eq!(
            (
                login.user.as_str(),
                login.vhost.as_deref(),
                login.client.as_deref()
            ),
            ("alice", Some("/"), Some("sensor-1"))
        );
        reg.info().with_login(|u, v, c| {
            assert_eq!((u, v, c), (Some("alice"), Some("/"), Some("sensor-1")))
        });
        reg.info().set_peer_cert_cn("device");
        assert_eq!(reg.info().peer_cert_cn().as_deref(), Some("device"));
        reg.info().with_login(|u, v, c| {
            assert_eq!((u, v, c), (Some("alice"), Some("/"), Some("sensor-1")))
        });
        assert!(r.by_core_id(7).is_some());
        // channels: registered in the scope, listed by number, gone when dropped
        let (three, one) = reg
            .scope(async { (open_channel(3), open_channel(1)) })
            .await;
        let (one, three) = (one.expect("in scope"), three.expect("in scope"));
        three.stats().set_prefetch(10, false);
        three.stats().set_mode(ChannelMode::Confirm);
        one.stats().set_unacked(4);
        let listed = reg.info().channels();
        assert_eq!(
            listed.iter().map(|c| c.number()).collect::<Vec<_>>(),
            vec![1, 3]
        );
        assert_eq!(listed[0].unacked(), 4);
        assert_eq!(listed[1].prefetch(), (10, 0));
        assert_eq!(listed[1].mode(), ChannelMode::Confirm);
        drop(listed);
        drop(three);
        assert_eq!(reg.info().channels().len(), 1);
        drop(one);
        assert!(reg.info().channels().is_empty());
        assert!(
            open_channel(5).is_none(),
            "outside a scope nothing is registered"
        );
        assert!(r.by_name("127.0.0.1:5000 (2)").is_none());
        assert!(r.by_name("garbage").is_none());
        assert_eq!(r.close_user("bob"), 0);
        assert_eq!(r.close_user("alice"), 1);
        assert!(token.is_cancelled());
        // outside a scope nothing is noted and nothing fails
        note_user("nobody");
        drop(reg);
        assert!(r.is_empty());
    }
}
