"""The coordinator's network-free brain: messages and ``now`` in, decisions and messages out.

``core`` (the engine's face: the server and the job call its named methods) over its parts, each
owning its state: ``admission`` (devices coming in; a tier's redirects), ``intake`` (the trainer's
GEMMs to their product), ``checks`` (verdicts, bands, credit), ``dispatch`` (the scheduler's
decisions carried out: the loop the simulator runs too) with ``leasing`` (its live hands),
``giveback`` (pauses and releases), ``upkeep`` (the tick), ``fleet`` (the planner's view of the
devices), ``relay_desk`` (relays); its records ``gemms``, ``devices``, ``progress`` and
``outbound`` (what it asks its driver to do);
``scheduler`` (which tile goes where and when, pure); ``conduct`` (the rules by which devices earn
and lose tiles, which the simulator runs too); ``identity`` (the gate: enrolment, credentials,
bans); ``limits`` (every limit a peer is held to); ``profiles`` (what each device can do,
measured); ``blocks`` (what devices cache); ``live_plan`` (the cost model applied to the
connected fleet); ``books`` (the job's own records); ``report`` (the status document and the
metrics counts, as views). The websocket server and the simulator both drive these same objects;
nothing here touches a socket.
It imports the wire contract, the planning maths and the store, never the net package.
"""
