from uibus_pb.cline import common_pb2


async def test_scroll_to_settings_reply(connect):
    conn = connect()
    reply = await conn.ui.scrollToSettings(common_pb2.StringRequest(value="browser"))
    assert (reply.key, reply.value) == ("scrollToSettings", "browser")
