//! Resource alarms (RabbitMQ's memory and disk alarms). While one is raised,
//! publishers are blocked — AMQP `connection.blocked`, and every protocol stops reading
//! from connections that publish — while consumers keep draining. The broker process
//! watches memory and disk and raises or clears them; adapters watch [`Alarms`].

/// Which alarms are raised.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Alarms {
    /// Memory use is above the high-water mark.
    pub memory: bool,
    /// Free disk space under the data directory is below the low-water mark (or the store
    /// reported a full disk).
    pub disk: bool,
}

impl Alarms {
    /// Whether publishers must wait.
    pub fn any(&self) -> bool {
        self.memory || self.disk
    }

    /// The reason to give clients (AMQP `connection.blocked` reason), if any.
    pub fn reason(&self) -> Option<&'static str> {
        match (self.memory, self.disk) {
            (true, true) => Some("low on memory and disk space"),
            (true, false) => Some("low on memory"),
            (false, true) => Some("low on disk space"),
            (false, false) => None,
        }
    }
}
