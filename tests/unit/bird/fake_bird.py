"""A fake BIRD control socket for the unit tests of the BIRD client and of tabbyctl's node
commands: a unix-socket server that greets like BIRD 2.0.12 and answers each command from
a table (anything else: ``9001 syntax error``), recording what it received; and BIRD
2.0.12's own replies to ``show protocols all`` and ``show status`` (captured from a running
daemon with the rendered ``timeformat``)."""

from __future__ import annotations

import socket
import threading

SHOW_PROTOCOLS_ALL = """\
2002-Name       Proto      Table      State  Since         Info
1002-tabby_device Device     ---        up     2026-11-23T11:08:21.354211+0000  
1006-
1002-tabby_blocks4 Static     master4    up     2026-11-23T11:08:21.354211+0000  
1006-  Channel ipv4
     State:          UP
     Table:          master4
     Preference:     200
     Input filter:   ACCEPT
     Output filter:  REJECT
     Routes:         1 imported, 0 exported, 1 preferred
 
1002-Mesh_10_77_0_2 BGP        ---        up     2026-11-23T13:08:23.076745+0200  Established   
1006-  Description:    node-b
     BGP state:          Established
       Neighbor address: 10.77.0.2
       Neighbor AS:      64512
       Local AS:         64512
       Neighbor ID:      10.77.0.2
       Local capabilities
         Multiprotocol
           AF announced: ipv4
       Session:          internal AS4
       Source address:   10.77.0.1
       Hold timer:       224.019/240
     Channel ipv4
       State:          UP
       Table:          master4
       Input filter:   tabby_import4
       Output filter:  tabby_export4
       Routes:         1 imported, 1 exported, 1 preferred
 
1002-Rr_fd77__3 BGP        ---        start  2026-11-23T11:08:37.212030+0000  \
Active        Socket: Connection refused
1006-  BGP state:          Active
       Neighbor address: fd77::3
       Neighbor AS:      64512
       Local AS:         64512
       Connect delay:    3.162/5
       Last error:       Socket: Connection refused
     Channel ipv6
       State:          DOWN
 
1002-bgp1       BGP        ---        up     2026-11-23T11:08:23.076745+0000  Established   
1006-  BGP state:          Established
 
0000 
"""

SHOW_STATUS = """\
1000-BIRD 2.0.12
1011-Router ID is 10.77.0.1
 Hostname is vm
 Current server time is 2026-11-23T11:09:51.946000+0000
 Last reboot on 2026-11-23T11:09:21.354000+0000
 Last reconfiguration on 2026-11-23T11:09:40.000000+0000
0024-Graceful restart recovery in progress
   Waiting for 1 channels to recover
   Wait timer is 3.412/20
0013 Daemon is up and running
"""


class FakeBird:
    """A unix-socket server that greets like BIRD and answers from a table."""

    def __init__(self, path: str, answers: dict[str, str]) -> None:
        self.path = path
        self.answers = answers
        self.received: list[str] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                f.write(b"0001 BIRD 2.0.12 ready.\n")
                f.flush()
                for raw in f:
                    cmd = raw.decode().rstrip("\n")
                    self.received.append(cmd)
                    f.write(self.answers.get(cmd, "9001 syntax error\n").encode())
                    f.flush()

    def close(self) -> None:
        self.sock.close()
