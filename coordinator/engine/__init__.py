"""The coordinator's network-free brain: messages and ``now`` in, decisions and messages out.

``core`` (the data plane: operands, blocks, verification, assembly, credit) with its parts
``gemms``, ``devices``, ``progress`` and ``outbound`` (what it asks its driver to do);
``scheduler`` (which tile goes where and when, pure); ``conduct`` (the rules by which devices earn
and lose tiles, which the simulator runs too); ``identity`` (the gate: enrolment, credentials,
bans); ``limits`` (every limit a peer is held to); ``profiles`` (what each device can do,
measured); ``blocks`` (what devices cache); ``live_plan`` (the cost model applied to the
connected fleet); ``books`` (the job's own records); ``report`` (the status document and the
metrics counts, as views). The websocket server and the simulator both drive these same objects;
nothing here touches a socket.
It imports the wire contract, the planning maths and the store, never the net package.
"""
