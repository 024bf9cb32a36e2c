"""The coordinator on the network: the websocket server that feeds the engine, the listening
socket, the web dashboard, Prometheus metrics, and ``RemoteEngine``, through which the trainer's
GEMMs reach the engine. Only I/O and wiring live here; every decision is the engine's.
"""
