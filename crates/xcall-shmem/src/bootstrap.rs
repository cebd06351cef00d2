//! Rendezvous of processing elements: in-process groups and Unix-socket bootstrap, with timeouts.
