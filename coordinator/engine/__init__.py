"""The coordinator's network-free brain: messages and ``now`` in, decisions and messages out.

``core`` (the data plane: operands, blocks, verification, assembly, credit), ``scheduler`` (which
tile goes where and when, pure), ``identity`` (the gate: enrolment, credentials, bans), ``limits``
(every limit a peer is held to), ``profiles`` (what each device can do, measured), ``blocks``
(what devices cache), ``live_plan`` (the cost model applied to the connected fleet). The
websocket server and the simulator both drive these same objects; nothing here touches a socket.
It imports the wire contract, the planning maths and the store, never the net package.
"""
