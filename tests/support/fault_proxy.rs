//! A TCP proxy on loopback whose faults are switched while it runs: what a network between
//! callbackd and its store, or its receivers, can do. The kernel here has no `netem`, so the
//! faults are made in user space, one connection task relaying both directions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the bytes it relays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Relays everything at once.
    Pass,
    /// Holds each chunk, in either direction, this long first.
    Latency(Duration),
    /// Relays nothing and answers nothing, on open and new connections, until healed; what
    /// was held then flows (a partition that heals).
    Blackhole,
    /// Resets open connections now, and every new one as soon as it is accepted.
    Reset,
    /// Relays this many more bytes from the server to the client on each connection, then
    /// closes it: a reply cut mid-frame.
    CutAfter(usize),
    /// Relays this many more bytes from the client to the server on each connection, then
    /// resets both: a reset in the middle of a request body.
    ResetAfter(usize),
    /// Relays the server's bytes one at a time, one per this interval.
    Trickle(Duration),
    /// The connections open now go silent for good (a NAT or firewall that dropped their
    /// flows, a host gone behind a partition), while new ones pass.
    Strand,
}

pub struct FaultProxy {
    pub port: u16,
    faults: watch::Sender<(Fault, u64)>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// A proxy on a free loopback port to `upstream`, passing everything.
    pub async fn start(upstream: SocketAddr) -> FaultProxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the proxy");
        let port = listener.local_addr().expect("its address").port();
        let (faults, _) = watch::channel((Fault::Pass, 0));
        let accepted = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn({
            let faults = faults.subscribe();
            let accepted = accepted.clone();
            async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(relay(client, upstream, faults.clone()));
                }
            }
        });
        FaultProxy {
            port,
            faults,
            accepted,
            task,
        }
    }

    pub fn set(&self, fault: Fault) {
        self.faults.send_modify(|(current, epoch)| {
            *current = fault;
            *epoch += 1;
        });
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Closes `stream` with a RST instead of a FIN.
fn reset(stream: TcpStream) {
    let _ = stream.set_zero_linger();
    drop(stream);
}

async fn relay(client: TcpStream, upstream: SocketAddr, mut faults: watch::Receiver<(Fault, u64)>) {
    let opened_in = faults.borrow_and_update().1;
    if faults.borrow().0 == Fault::Reset {
        return reset(client);
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return reset(client);
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client, mut server) = (client, server);
    let mut stranded = false;
    // Bytes relayed since the current fault began, for `CutAfter` and `ResetAfter`.
    let mut relayed_in_fault = 0usize;
    let mut fault_epoch = opened_in;
    let (mut up, mut down) = (vec![0u8; 16 * 1024], vec![0u8; 16 * 1024]);
    loop {
        let (fault, epoch) = *faults.borrow_and_update();
        if epoch != fault_epoch {
            fault_epoch = epoch;
            relayed_in_fault = 0;
        }
        if fault == Fault::Strand && opened_in < epoch {
            stranded = true;
        }
        if fault == Fault::Reset {
            reset(server);
            return reset(client);
        }
        if stranded {
            // Silent for good: what the client sends is swallowed, until it gives up.
            loop {
                match client.read(&mut up).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {}
                }
            }
        }
        if fault == Fault::Blackhole {
            if faults.changed().await.is_err() {
                return;
            }
            continue;
        }
        tokio::select! {
            changed = faults.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            read = client.read(&mut up) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                match fault {
                    Fault::Latency(delay) => tokio::time::sleep(delay).await,
                    Fault::ResetAfter(limit) => {
                        let allowed = limit.saturating_sub(relayed_in_fault).min(n);
                        let _ = server.write_all(&up[..allowed]).await;
                        relayed_in_fault += allowed;
                        if relayed_in_fault >= limit {
                            reset(server);
                            return reset(client);
                        }
                        continue;
                    }
                    _ => {}
                }
                if server.write_all(&up[..n]).await.is_err() {
                    return;
                }
            }
            read = server.read(&mut down) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                match fault {
                    Fault::Latency(delay) => tokio::time::sleep(delay).await,
                    Fault::CutAfter(limit) => {
                        let allowed = limit.saturating_sub(relayed_in_fault).min(n);
                        let _ = client.write_all(&down[..allowed]).await;
                        relayed_in_fault += allowed;
                        if relayed_in_fault >= limit {
                            return;
                        }
                        continue;
                    }
                    Fault::Trickle(every) => {
                        for byte in &down[..n] {
                            if client.write_all(std::slice::from_ref(byte)).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(every).await;
                        }
                        continue;
                    }
                    _ => {}
                }
                if client.write_all(&down[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
}
